"""The file backend: one line per key across the processes of one host, with no server.

::

    from inturn import KeyedQueue
    from inturn.backends.file import FileBackend

    downloads = KeyedQueue(backend=FileBackend("/var/run/myapp/inturn"))

How a line is kept (every step is a plain file operation; nothing polls):

- Each key has a *line file*, ``<digest>.line``, named by the SHA-256 of
  the key (never the key itself, so no key can name a file outside the
  directory). It lists the *tickets* of the key's line in arrival order,
  after the last fencing token handed out. It is only read or written under
  an exclusive ``flock`` on itself, held for a few system calls.
- A ticket is a FIFO (named pipe), ``<digest>.<pid>.<random>.t``, that its
  owner keeps open for writing from the moment it queues until it leaves.
  While the owner lives and holds or waits, the FIFO has a writer. When the
  owner releases, gives up, or dies (even by SIGKILL, as the kernel closes
  the dead process's files), the FIFO has none, and a reader sees end of
  file at once.
- To queue, a process creates and opens its ticket, then appends it to the
  line file. It holds the key once every ticket before its own has no
  writer: it waits for end of file on the nearest one that still has one,
  in its event loop (no thread, no sleep), then looks further back.
- To release, the holder, under the line file's lock, drops its own ticket
  and every ticket that has no writer any more (deleting those FIFOs), and
  deletes the line file if that leaves it empty; then it closes its ticket.

Why two processes never hold a key at once: a process holds only when
every earlier ticket in the line has no writer, and a holder keeps its
ticket's writer open until it has finished; the order of tickets in a line
only changes by dropping tickets that have no writer. Deleting a line file
is done under its lock, and a process that locked a line file checks it is
still the file at that path before it trusts it, so two processes never
work on two different line files for one key.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import secrets
import stat
import sys
import tempfile
import time
from collections.abc import Hashable
from pathlib import Path
from typing import final

from .._keys import order_portable, portable_name
from ._base import Grant

__all__ = ("FileBackend", "FileGrant")

if sys.platform == "win32":  # pragma: no cover - checked at construction
    fcntl = None
else:
    import fcntl

_TICKET = ".t"
_LINE = ".line"

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


def _prepare(directory: Path) -> Path:
    """Create directory owner-only if missing; refuse one that is not ours."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file, not a directory: refused below
    try:
        info = os.lstat(directory)
    except OSError as error:
        raise OSError(error.errno, f"inturn: cannot use {directory} for lines: {error}") from None
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(
            f"inturn: {directory} is a symbolic link; give FileBackend the real directory "
            f"({os.path.realpath(directory)}), so nobody can swap the link"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"inturn: {directory} exists and is not a directory")
    if info.st_uid != os.geteuid():
        raise PermissionError(
            f"inturn: {directory} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}); whoever owns it could break or fake the lines. "
            "Use a directory of your own"
        )
    return directory


def _has_writer(path: Path) -> int | None:
    """Open ticket FIFO path for reading; return the fd if its owner is still in line.

    Return None if the ticket is gone or has no writer (its owner left or
    died). The returned fd reports end of file when the owner leaves.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        # Read once at once: with no writer this is end of file (and Linux
        # would not report a hang-up for a writer that left before the open).
        while os.read(fd, 512):
            pass  # nobody writes into tickets; drain anything that was
    except BlockingIOError:
        return fd  # a writer holds it open: its owner is in line
    os.close(fd)
    return None


async def _until_closed(fd: int, deadline: float | None, key: Hashable) -> None:
    """Wait in the event loop until ticket fd reports end of file (its owner left)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            while os.read(fd, 512):
                pass  # drained; the owner is still there
        except BlockingIOError:
            return
        if not done.done():
            done.set_result(None)

    def expire() -> None:
        if not done.done():
            done.set_exception(
                TimeoutError(f"inturn: the turn for key {key!r} was not reached in time")
            )

    loop.add_reader(fd, readable)
    timer = None if deadline is None else loop.call_at(deadline, expire)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def _same_file(fd: int, path: Path) -> bool:
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


async def _lock_line(path: Path) -> int:
    """Open and exclusively lock the line file at path (creating it); return its fd.

    The lock is held by other processes for a few system calls at most, so
    it is first tried without blocking; only if that fails is the blocking
    call made, in a thread, so the event loop never waits on it.
    """
    assert fcntl is not None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            locking = asyncio.get_running_loop().run_in_executor(
                None, fcntl.flock, fd, fcntl.LOCK_EX
            )
            try:
                await asyncio.shield(locking)
            except BaseException:
                # Cancelled while the thread waits: it still gets the lock
                # some day; closing the fd then lets it go.
                locking.add_done_callback(lambda _, fd=fd: os.close(fd))  # type: ignore[misc]
                raise
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # deleted (or replaced) by its last user meanwhile: start again


def _unlock_line(fd: int) -> None:
    os.close(fd)  # closing drops the flock


def _read_line(fd: int) -> tuple[int, list[str]]:
    """The line file's last token and its tickets, in order."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    text = b"".join(chunks).decode("ascii")
    if not text:
        return 0, []
    first, *tickets = text.split("\n")
    return int(first), [ticket for ticket in tickets if ticket]


def _write_line(fd: int, token: int, tickets: list[str]) -> None:
    data = "\n".join((str(token), *tickets, "")).encode("ascii")
    # Write, then cut to length: never truncate to zero, which makes ext4
    # flush the file to disk on close (its rewrite-in-place heuristic).
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@final
class FileGrant:
    """The turn on one key granted by a :class:`FileBackend`, while it lasts."""

    __slots__ = ("_fd", "_line", "_ticket", "key", "token")

    def __init__(self, key: Hashable, token: int, fd: int, ticket: Path, line: Path) -> None:
        #: The key held.
        self.key = key
        #: The fencing token: larger than every earlier grant's on this key
        #: while the key's line lives, and taken from the wall clock in
        #: nanoseconds when a line starts anew.
        self.token = token
        self._fd = fd  # the writer end of this grant's ticket: open while it holds
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

    :param directory: where the line files live, created owner-only (mode
        0700) if missing. Every process that shares the lines must use the
        same directory. Default: ``inturn-<uid>`` in the system's temporary
        directory.
    :raises RuntimeError: the platform is not POSIX.
    :raises PermissionError: the directory belongs to another user, or is a
        symbolic link.
    :raises NotADirectoryError: the path exists and is not a directory.
    """

    __slots__ = ("_directory",)

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        _check_platform()
        path = _default_directory() if directory is None else Path(directory)
        self._directory = _prepare(path.absolute())

    @property
    def directory(self) -> Path:
        """The directory holding the line files."""
        return self._directory

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Sort keys into the order every process computes (by their portable names).

        :raises TypeError: a key is not a ``str``, ``bytes`` or ``int``.
        """
        return order_portable(keys)

    def _paths(self, key: Hashable) -> tuple[str, Path]:
        digest = hashlib.sha256(portable_name(key)).hexdigest()
        return digest, self._directory / f"{digest}{_LINE}"

    async def acquire(self, key: Hashable, timeout: float | None) -> FileGrant:
        """Queue in key's line file and wait until every ticket before ours has left.

        :raises TimeoutError: the turn was not reached within ``timeout``;
            this process's ticket left the line.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        digest, line = self._paths(key)
        name = f"{digest}.{os.getpid()}.{secrets.token_hex(6)}{_TICKET}"
        ticket = self._directory / name
        os.mkfifo(ticket, 0o600)
        try:
            fd = os.open(ticket, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            _unlink(ticket)
            raise
        _OPEN_TICKETS.add(fd)
        try:
            line_fd = await _lock_line(line)
            try:
                last, before = _read_line(line_fd)
                token = max(last + 1, time.time_ns())
                _write_line(line_fd, token, [*before, name])
            finally:
                _unlock_line(line_fd)
            # Hold once every earlier ticket has no writer: wait on the
            # nearest one that has, then look further back. A ticket that
            # lost its writer never gets one again.
            for earlier in reversed(before):
                waiting = _has_writer(self._directory / earlier)
                if waiting is None:
                    continue
                try:
                    if deadline is not None and loop.time() >= deadline:
                        raise TimeoutError(
                            f"inturn: the turn for key {key!r} was not reached in time"
                        )
                    await _until_closed(waiting, deadline, key)
                finally:
                    os.close(waiting)
        except BaseException:
            # Leave the line: with no writer, the tickets behind skip this one.
            _OPEN_TICKETS.discard(fd)
            os.close(fd)
            _unlink(ticket)
            raise
        return FileGrant(key, token, fd, ticket, line)

    async def release(self, grant: Grant) -> None:
        """Drop grant's ticket (and any left by processes that died) and end its turn."""
        if not isinstance(grant, FileGrant):
            raise TypeError(f"inturn: {self!r} cannot release {grant!r}, which it did not grant")
        if grant._fd < 0:
            return
        line = grant._line
        own = grant._ticket.name
        try:
            line_fd = await _lock_line(line)
        except BaseException:
            self._close(grant)  # ends the turn all the same: the next in line goes on
            raise
        try:
            token, tickets = _read_line(line_fd)
            keep = []
            for name in tickets:
                if name == own:
                    continue
                fd = _has_writer(self._directory / name)
                if fd is None:
                    _unlink(self._directory / name)  # its owner died or left
                else:
                    os.close(fd)
                    keep.append(name)
            if keep:
                _write_line(line_fd, token, keep)
            else:
                os.unlink(line)  # under its lock: see _lock_line's check
        finally:
            _unlock_line(line_fd)
            self._close(grant)

    @staticmethod
    def _close(grant: FileGrant) -> None:
        fd, grant._fd = grant._fd, -1
        _OPEN_TICKETS.discard(fd)
        _unlink(grant._ticket)
        try:
            os.close(fd)  # the writer goes: whoever waits on this ticket goes on
        except OSError as error:  # pragma: no cover - closed twice would be a bug
            if error.errno != errno.EBADF:
                raise

    def line(self, key: Hashable) -> tuple[int, ...]:
        """The process ids in key's line, in turn order, as the line file has them now.

        The first holds the key (or is being handed it); the rest wait. A
        process appears once per queue that waits for the key. For
        operators and tests: the answer may be stale by the time it returns.
        """
        assert fcntl is not None
        _, line = self._paths(key)
        try:
            fd = os.open(line, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return ()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # writers hold it for a few system calls
            _, tickets = _read_line(fd)
        finally:
            os.close(fd)
        pids = []
        for name in tickets:
            reader = _has_writer(self._directory / name)
            if reader is not None:
                os.close(reader)
                pids.append(int(name.split(".")[1]))
        return tuple(pids)

    async def aclose(self) -> None:
        """Nothing to close: every grant's files are closed by its release."""

    def __repr__(self) -> str:
        return f"FileBackend({str(self._directory)!r})"
