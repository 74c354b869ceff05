"""The file backend: one line per key across the processes of one host, with no server.

::

    from inturn import KeyedQueue
    from inturn.backends.file import FileBackend

    downloads = KeyedQueue(backend=FileBackend("/var/run/myapp/inturn"))

How a line is kept (every step is a plain file operation; nothing polls):

- A *ticket* is a FIFO (named pipe), ``<digest>.<pid>.<random>.t``, that
  its owner keeps open for writing from the moment it queues until it
  leaves. While the owner waits or holds, the FIFO has a writer; once it
  releases, gives up, or dies (even by SIGKILL: the kernel closes a dead
  process's files), the FIFO has none, and never gets one back. A reader
  of the FIFO sees end of file at that moment.
- Each key has a *line file*, ``<digest>.line``, named by the SHA-256 of
  the key (never the key itself, so no key can name a file outside the
  directory): the names of the key's tickets, in arrival order, one per
  line. A process queues by appending its ticket's name to it (one
  ``O_APPEND`` write, under a shared ``flock``, so arrivals never wait for
  each other) and reading the names before its own.
- A process holds the key once every ticket before its own has no writer.
  It waits, in its event loop, for end of file on the nearest one that
  still has one. A holder that releases writes ``H<token>`` into its ticket
  before closing it: whoever waits on it then knows every earlier ticket
  is done too, and takes the key at once, with the next fencing token. If
  the ticket closed without that (its owner gave up or died), the waiter
  looks further back.
- After releasing, a holder tidies up: if no ticket behind it is still in
  line, it deletes the line file and the FIFOs it lists, under an
  exclusive ``flock``; a long line file is compacted the same way.

Why two processes never hold a key at once: a process holds only when
every earlier ticket in the line has no writer, and a holder keeps its
ticket's writer open until its work is done. The line file only ever
changes by appending, or, under the exclusive lock, by dropping tickets
that have no writer. A process that locked a line file checks that it is
still the file at that path before it trusts it, so two processes never
work on two different line files for one key.

Every file is opened relative to the directory's descriptor and never
through a symbolic link (see ``_directory.py`` for which directories are
accepted); if the directory is removed, the next turn makes it again,
with the same checks.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Hashable
from pathlib import Path
from typing import final

from .._keys import order_portable, portable_name
from ._base import Grant
from ._directory import Directory

__all__ = ("FileBackend", "FileGrant")

if sys.platform == "win32":  # pragma: no cover - checked at construction
    fcntl = None
else:
    import fcntl

_TICKET = ".t"
_LINE = ".line"
#: What a releasing holder writes into its ticket: H, then its token.
_HANDED = b"H"
#: Compact a line file whose names outnumber this (dead tickets pile up in a busy line).
_COMPACT_AT = 64
#: Bytes read from a line file at once.
_READ = 65536
#: Tries at a line file's lock before waiting for it in a thread (see _flock_soon).
_FLOCK_TRIES = 16
#: How a line file is opened: for appending, made if missing, never through a link.
_OPEN_LINE = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
#: How a ticket's owner opens it: as its writer (O_RDWR: without waiting for a reader).
_OPEN_TICKET = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
#: How a ticket is looked at: read, without waiting for a writer, never through a link.
_OPEN_PROBE = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

# The writer ends of the tickets this process holds open. A child forked
# while a ticket is open closes its copies at once: otherwise the ticket
# would keep a writer, and its line would wait for the child to exit.
_OPEN_TICKETS: set[int] = set()


def _close_inherited_tickets() -> None:
    for fd in _OPEN_TICKETS:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover - closed by the child's own code already
            pass
    _OPEN_TICKETS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_tickets)


def _check_platform() -> None:
    if fcntl is None or not hasattr(os, "mkfifo"):
        raise RuntimeError(
            "inturn: FileBackend needs a POSIX system (flock and named pipes); "
            f"this is {sys.platform}. Use the in-process default or the Redis backend."
        )


def _default_directory() -> Path:
    return Path(tempfile.gettempdir()) / f"inturn-{os.geteuid()}"


def _probe(directory: int, name: str) -> tuple[int | None, bytes]:
    """Open ticket FIFO name for reading: (fd, data) if its owner is still in line.

    The fd is None if the ticket is gone or has no writer (its owner left or
    died), or is not a FIFO of ours but a symbolic link; data is what the
    owner wrote into it (``H<token>`` on release). An fd that is returned
    reports end of file when the owner leaves.
    """
    try:
        fd = os.open(name, _OPEN_PROBE, dir_fd=directory)
    except FileNotFoundError:
        return None, b""
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, b""  # a link in place of a ticket: not one of ours
        raise
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


async def _until_closed(fd: int, deadline: float | None, key: Hashable) -> bytes:
    """Wait in the event loop until ticket fd reports end of file; return what it carried."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bytes] = loop.create_future()
    data = bytearray()

    def readable() -> None:
        try:
            while chunk := os.read(fd, 64):
                data.extend(chunk)
        except BlockingIOError:
            return  # data, and the owner is still there
        if not done.done():
            done.set_result(bytes(data))

    def expire() -> None:
        if not done.done():
            done.set_exception(
                TimeoutError(f"inturn: the turn for key {key!r} was not reached in time")
            )

    loop.add_reader(fd, readable)
    timer = None if deadline is None else loop.call_at(deadline, expire)
    try:
        return await done
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def _still_there(fd: int) -> bool:
    """Whether the file open at fd is still in the directory (its last user did not delete it).

    A line file only ever leaves its path by being deleted (never renamed
    or replaced), so one that still has a name has the name it was opened by.
    """
    return os.fstat(fd).st_nlink > 0


def _flock_soon(fd: int, mode: int) -> None:
    """flock fd in mode if that takes no longer than its holder's few system calls.

    Yields the CPU between a few tries, so that a holder on this core can
    finish; raises BlockingIOError if the lock is still held after them.
    """
    assert fcntl is not None
    for _ in range(_FLOCK_TRIES):
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.sched_yield()
        else:
            return
    fcntl.flock(fd, mode | fcntl.LOCK_NB)


def _open_line(directory: Directory, name: str) -> int:
    """Open (making it if missing) the line file name in directory."""
    try:
        return os.open(name, _OPEN_LINE, 0o600, dir_fd=directory.fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise PermissionError(
                f"inturn: the line file {directory.path / name} is a symbolic link, which "
                "inturn never follows: another process of this user put it there. Remove it"
            ) from None
        raise


def _try_lock_line(directory: Directory, name: str, mode: int) -> int | None:
    """Open the line file name (creating it) and flock it in mode; return its fd.

    Others hold the lock for a few system calls, so it is only tried, a few
    times (see _flock_soon): None if it is still taken.
    """
    while True:
        fd = _open_line(directory, name)
        try:
            _flock_soon(fd, mode)
        except BaseException as error:
            os.close(fd)
            if isinstance(error, BlockingIOError):
                return None
            raise
        if _still_there(fd):
            return fd
        os.close(fd)  # deleted by its last user meanwhile: start again


async def _lock_line(directory: Directory, name: str, mode: int) -> int:
    """As _try_lock_line, but if the lock stays taken, wait for it in a thread.

    So the event loop never waits on the blocking call.
    """
    assert fcntl is not None
    while (fd := _try_lock_line(directory, name, mode)) is None:
        fd = _open_line(directory, name)
        locking = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, mode)
        try:
            await asyncio.shield(locking)
        except BaseException:
            # Cancelled while the thread waits: it still gets the lock
            # some day; closing the fd then lets it go.
            locking.add_done_callback(lambda _, fd=fd: os.close(fd))  # type: ignore[misc]
            raise
        if _still_there(fd):
            return fd
        os.close(fd)  # deleted by its last user meanwhile: start again
    return fd


def _names(fd: int) -> list[str]:
    """The ticket names in the line file, in order (a last line still being written is left out)."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, _READ, offset):
        chunks.append(chunk)
        offset += len(chunk)
        if len(chunk) < _READ:  # the end (an append since is not ours to see)
            break
    text = b"".join(chunks).decode("ascii")
    return text.split("\n")[:-1]


def _rewrite(directory: Directory, name: str, names: list[str]) -> None:
    """Replace the line file's names; the caller holds its exclusive lock."""
    data = "".join(f"{name}\n" for name in names).encode("ascii")
    # not O_APPEND: written from the start
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory.fd)
    try:
        # Write, then cut to length: never truncate to zero, which makes ext4
        # flush the file to disk on close (its rewrite-in-place heuristic).
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _unlink(directory: Directory, name: str) -> None:
    try:
        os.unlink(name, dir_fd=directory.fd)
    except FileNotFoundError:
        pass


def _alive(directory: Directory, name: str) -> bool:
    fd, _ = _probe(directory.fd, name)
    if fd is None:
        return False
    os.close(fd)
    return True


@final
class FileGrant:
    """The turn on one key granted by a :class:`FileBackend`, while it lasts."""

    __slots__ = ("_directory", "_fd", "_line", "_ticket", "key", "token")

    def __init__(
        self, key: Hashable, token: int, fd: int, directory: Directory, ticket: str, line: str
    ) -> None:
        #: The key held.
        self.key = key
        #: The fencing token: one above the previous holder's while the key's
        #: line is busy, and the wall clock in nanoseconds when it starts anew.
        self.token = token
        self._fd = fd  # the writer end of this grant's ticket: open while it holds
        self._directory = directory  # where its ticket and line file are
        self._ticket = ticket
        self._line = line

    @property
    def lost(self) -> bool:
        """Always ``False``: the kernel keeps a file turn for as long as its process lives."""
        return False

    def __repr__(self) -> str:
        held = "held" if self._fd >= 0 else "released"
        return f"<FileGrant key={self.key!r} token={self.token} {held}>"


@final
class FileBackend:
    """Lines shared by the processes of one host through a directory, with no server.

    Guarantees, among every process using the same directory:

    - Mutual exclusion per key.
    - Order: turns are granted in the order submissions were registered in
      the key's line file; each process's own submissions keep their order
      (its queue sends one at a time per key, in its own FIFO order).
    - Crash safety from the kernel: a process killed while holding a key
      (SIGKILL included) releases it at once, and one killed while waiting is
      skipped; nothing needs a lease or a clean-up to recover.
    - Waiting costs no CPU and never blocks the event loop: a waiter sleeps
      in the loop until the kernel reports that the ticket before it
      closed. Timeouts and cancellation take effect at once.
    - Files are named by a digest of the key, so any ``str``, ``bytes`` or
      ``int`` key is safe, however long and whatever it contains. A line's
      files are deleted by its last holder (tickets of crashed processes by
      the next holder of that key).

    Not guaranteed: fairness beyond arrival order; exclusion between hosts
    sharing a network file system (use the Redis backend across hosts); and
    fencing tokens that survive the wall clock being set back while a key is
    idle.

    Shared directories: a directory that others may write to is refused,
    unless it has the sticky bit (as ``/tmp`` has); the files then go to
    ``inturn-<uid>``, an owner-only subdirectory of this user's in it. No
    file is ever opened through a symbolic link. If the directory is
    removed, the next turn makes it again, with the same checks.

    :param directory: where the line files live, created owner-only (mode
        0700) if missing. Every process that shares the lines must use the
        same directory. Default: ``inturn-<uid>`` in the system's temporary
        directory.
    :raises RuntimeError: the platform is not POSIX.
    :raises PermissionError: the directory belongs to another user, is a
        symbolic link, or may be written by others and has no sticky bit.
    :raises NotADirectoryError: the path exists and is not a directory.
    """

    __slots__ = ("_given", "_where")

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        _check_platform()
        path = _default_directory() if directory is None else Path(directory)
        self._given = path.absolute()  # found again, with the same checks, if removed
        self._where = Directory.open(self._given)

    @property
    def directory(self) -> Path:
        """The directory holding the line files (``inturn-<uid>`` in a sticky one)."""
        return self._where.path

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Sort keys into the order every process computes (by their portable names).

        :raises TypeError: a key is not a ``str``, ``bytes`` or ``int``.
        """
        return order_portable(keys)

    def _found_again(self, lost: Directory) -> Directory:
        """The directory, made and checked again: lost was removed."""
        if self._where is lost:
            self._where = Directory.open(self._given)
        return self._where

    async def acquire(self, key: Hashable, timeout: float | None) -> FileGrant:
        """Queue in key's line file and wait until every ticket before ours has left.

        :raises TimeoutError: the turn was not reached within ``timeout``;
            this process's ticket left the line.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        digest = hashlib.sha256(portable_name(key)).hexdigest()
        line = digest + _LINE
        name = f"{digest}.{os.getpid()}.{secrets.token_hex(6)}{_TICKET}"
        where = self._where
        while True:
            try:
                os.mkfifo(name, 0o600, dir_fd=where.fd)
            except FileNotFoundError:
                where = self._found_again(where)  # the directory was removed
            else:
                break
        try:
            fd = os.open(name, _OPEN_TICKET, dir_fd=where.fd)
        except BaseException:
            _unlink(where, name)
            raise
        _OPEN_TICKETS.add(fd)
        try:
            line_fd = await _lock_line(where, line, fcntl.LOCK_SH)
            try:
                os.write(line_fd, f"{name}\n".encode("ascii"))  # one append: atomic
                names = _names(line_fd)
            finally:
                os.close(line_fd)
            token = await self._wait_behind(where, names[: names.index(name)], deadline, key)
        except BaseException:
            # Leave the line: with no writer, the tickets behind skip this one.
            _OPEN_TICKETS.discard(fd)
            os.close(fd)
            _unlink(where, name)
            raise
        return FileGrant(key, token, fd, where, name, line)

    async def _wait_behind(
        self, where: Directory, before: list[str], deadline: float | None, key: Hashable
    ) -> int:
        """Wait until no ticket of before has a writer; return the fencing token to hold with."""
        loop = asyncio.get_running_loop()
        for earlier in reversed(before):
            fd, data = _probe(where.fd, earlier)
            if fd is not None:
                try:
                    if deadline is not None and loop.time() >= deadline:
                        raise TimeoutError(
                            f"inturn: the turn for key {key!r} was not reached in time"
                        )
                    data += await _until_closed(fd, deadline, key)
                finally:
                    os.close(fd)
            if data.startswith(_HANDED):
                # It held the key, so every ticket before it has left too.
                return max(int(data[1:]) + 1, time.time_ns())
        return time.time_ns()

    def release(self, grant: Grant) -> Awaitable[None]:
        """Hand the key on (close grant's ticket), then tidy the line file up.

        Done at once, in a few system calls: the answer is a finished Future.
        """
        if not isinstance(grant, FileGrant):
            raise TypeError(f"inturn: {self!r} cannot release {grant!r}, which it did not grant")
        done = asyncio.get_running_loop().create_future()
        fd, grant._fd = grant._fd, -1
        if fd >= 0:
            _OPEN_TICKETS.discard(fd)
            try:
                os.write(fd, _HANDED + str(grant.token).encode("ascii"))
            finally:
                os.close(fd)  # no writer now: whoever waits on this ticket goes on
                _unlink(grant._directory, grant._ticket)
            self._tidy(grant._directory, grant._line, grant._ticket)
        done.set_result(None)
        return done

    def _tidy(self, where: Directory, line: str, own: str) -> None:
        """Delete the line file if nobody is in line any more; compact it if it grew long.

        Best effort: if another process holds the line file's lock, it is
        left for a later release (whoever holds that lock is in line).
        """
        assert fcntl is not None
        fd = _try_lock_line(where, line, fcntl.LOCK_SH)
        if fd is None:
            return
        try:
            names = _names(fd)
            behind = names[names.index(own) + 1 :] if own in names else names
            # The newest first: in a busy line, the first one looked at is alive.
            someone = any(_alive(where, n) for n in reversed(behind))
        finally:
            os.close(fd)
        if someone and len(names) <= _COMPACT_AT:
            return
        fd = _try_lock_line(where, line, fcntl.LOCK_EX)
        if fd is None:
            return
        try:
            names = _names(fd)
            alive = [n for n in names if _alive(where, n)]
            for name in names:
                if name not in alive:
                    _unlink(where, name)  # left by one that died
            if alive:
                _rewrite(where, line, alive)
            else:
                os.unlink(line, dir_fd=where.fd)  # under its lock: see _lock_line's check
        finally:
            os.close(fd)

    def line(self, key: Hashable) -> tuple[int, ...]:
        """The process ids in key's line, in turn order, as the line file has them now.

        The first holds the key (or is being handed it); the rest wait. A
        process appears once per queue that waits for the key. For
        operators and tests: the answer may be stale by the time it returns.
        """
        assert fcntl is not None
        where = self._where
        line = hashlib.sha256(portable_name(key)).hexdigest() + _LINE
        try:
            fd = os.open(line, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=where.fd)
        except FileNotFoundError:
            return ()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # others hold it for a few system calls
            names = _names(fd)
        finally:
            os.close(fd)
        return tuple(int(name.split(".")[1]) for name in names if _alive(where, name))

    async def aclose(self) -> None:
        """Nothing to close: every grant's files are closed by its release."""

    def __repr__(self) -> str:
        return f"FileBackend({str(self.directory)!r})"
