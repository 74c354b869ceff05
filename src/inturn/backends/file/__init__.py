"""The file backend: one line per key across the processes of one host, with no server.

::

    from inturn import KeyedQueue
    from inturn.backends.file import FileBackend

    downloads = KeyedQueue(backend=FileBackend("/var/run/myapp/inturn"))

How a line is kept (every step is a plain file operation; nothing polls,
but the rare wait for a line file's lock that its holder keeps for longer
than its few system calls, see ``_locks.py``, and the last holder's
retry of a tidy that found the lock busy, see ``_tidy.py``):

- A *ticket* is a FIFO (named pipe), ``<digest>.<pid>.<random>.t``, that
  its owner keeps open for writing from the moment it queues until it
  leaves. While the owner waits or holds, the FIFO has a writer; once it
  releases, gives up, or dies (even by SIGKILL: the kernel closes a dead
  process's files), the FIFO has none, and never gets one back. A reader
  of the FIFO sees end of file at that moment.
- Each key has a *line file*, ``<digest>.line``, named by the SHA-256 of
  the key's portable name (never the key itself, so no key can name a
  file outside the directory): the key's tickets, in arrival order, one
  record per line (``_linefile.py`` has the format). A process queues
  under a shared ``flock`` of the line file, so arrivals never wait for
  each other: it appends a mark that its ticket is coming, makes the
  FIFO, appends the ticket (each one ``O_APPEND`` write), and reads the
  tickets before its own. It then closes the line file (it opens it again
  to tidy up), so a turn keeps one file open while it holds: its ticket.
- A process holds the key once every ticket before its own has no writer,
  or has handed the key on. It waits, in its event loop, on the nearest one
  that still has a writer. A holder that releases writes ``H<token>`` into
  its ticket, then closes it: whoever waits on it takes the key as soon as
  it reads that, with the next fencing token (the holder held, so every
  earlier ticket is done too). If the ticket closed without it (its owner
  gave up or died), the waiter looks further back. A holder that finds
  its line file grown past its own record (someone queued behind it)
  then yields its CPU: the next holder's work holds up the line, its own
  tidy and next turn do not.
- After releasing (or giving up), a process tidies up: if no ticket behind
  its own is still in line, or the file grew long, it finds which tickets
  have no writer and removes their FIFOs, under the shared lock; then,
  under the exclusive lock, for a few system calls only, it deletes the
  line file if nobody is left in it, or writes the tickets still in line
  over the old records and cuts the file to them.

Why two processes never hold a key at once: a process holds only when
every earlier ticket in the line has no writer, and a holder keeps its
ticket's writer open until its work is done. The line file only ever
changes by appending, or, under the exclusive lock, by dropping tickets
that have no writer. A process that locked a line file checks that it is
still the file at that path before it trusts it, so two processes never
work on two different line files for one key.

Why a crash at any instruction leaves every line usable, and every file
removed by a later turn on the key: a FIFO is made only after the mark
that it is coming, so a process killed while queueing leaves a mark that
the next tidy under the exclusive lock, where nobody can be queueing,
reads as "died here" (the FIFO, if made, is removed). A ticket left by a
killed process has no writer, so it is skipped like one that left, and
tidied. A compaction killed between its write and its cut leaves records
that read back right (see ``_linefile.py``), and its write is never
longer than the kernel does at once.

A process with no file descriptor left (see ``_limits.py``) is
refused before it is in line, or leaves the line as at a timeout. A join
that fails once its mark is written (no descriptor left for its FIFO)
takes the mark out under the exclusive lock, or deletes the line file if
the mark was all that was in it (see ``_tidy.py``: withdraw).

Every file is opened relative to the directory's descriptor and never
through a symbolic link (see ``_directory.py`` for which directories are
accepted); if the directory is removed, the next turn makes it again,
with the same checks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Awaitable, Coroutine, Hashable
from pathlib import Path
from typing import Any, Final, final

from ..._describe import describe
from ..._order import order_portable, portable_name
from .._base import Capabilities, Grant, Newest
from .._lines import LineInfo
from ._directory import Directory
from ._fds import forks
from ._inspect import pids_in_line, snapshots
from ._limits import refusal
from ._line import Home, Place, Taking, deleted, drive, drive_blocking, leave, taking
from ._linefile import Ran
from ._tidy import retry, retry_aside

__all__ = ("FileBackend", "FileGrant")

#: What this backend logs: only what is rare, never a turn that went as it should.
logger = logging.getLogger("inturn.file")

if sys.platform == "win32":  # pragma: no cover - checked at construction
    fcntl = None
else:
    import fcntl


def _check_platform() -> None:
    if fcntl is None or not hasattr(os, "mkfifo"):
        raise RuntimeError(
            "inturn: FileBackend needs a POSIX system (flock and named pipes); "
            f"this is {sys.platform}. Use the in-process default or the Redis backend."
        )


#: Where the default directory goes on Linux: a file system in memory (tmpfs). A
#: turn makes and deletes two names (its line file, its ticket); on a disk's file
#: system, journaled, that is most of what a turn on a free key costs.
_IN_MEMORY = Path("/dev/shm")


def _default_directory() -> Path:
    """``inturn-<uid>`` in /dev/shm on Linux if this user may write there, else in the
    system's temporary directory. Looked at (two stats), never written to, here."""
    usable = (
        sys.platform.startswith("linux")
        and _IN_MEMORY.is_dir()
        and os.access(_IN_MEMORY, os.W_OK | os.X_OK)
    )
    base = _IN_MEMORY if usable else Path(tempfile.gettempdir())
    return base / f"inturn-{os.geteuid()}"


@final
class FileGrant:
    """The turn on one key granted by a :class:`FileBackend`, while it lasts."""

    __slots__ = ("_forks", "_loop", "_place", "key", "token")

    def __init__(self, key: Hashable, token: int, place: Place) -> None:
        #: The key held.
        self.key = key
        #: The fencing token: one above the previous holder's while the key's
        #: line is busy, and the wall clock in nanoseconds when it starts anew.
        self.token = token
        self._place = place  # its ticket (open while it holds, its one file) and its line file
        self._forks = forks()  # (a forked child's count differs: the grant is its parent's)
        self._loop: asyncio.AbstractEventLoop | None = None  # a task's grant's (see release)

    @property
    def lost(self) -> bool:
        """Whether the grant's line file or ticket was deleted (or replaced) while it held.

        The kernel keeps a file turn for as long as its process lives, so
        this is ``False`` unless something outside the backend removed its
        files: another process of this user, or a cleaner of the directory.
        Another process may then have been given the key meanwhile, and the
        turn raises :exc:`~inturn.LeaseLost` when it ends. Found from the
        link count of its ticket, which the grant keeps open, and the line
        file at its name: its identity (device and inode number), and that
        it lists the grant's ticket, a few system calls. Not detected: a line
        file edited in place; one deleted and made again with the same inode
        number, found by a release with no file descriptor left to read it.
        """
        place = self._place
        if place.fd < 0 or self._forks != forks():  # (a forked child: its parent's, see release)
            return place.lost
        return deleted(place)

    def ran(self, called: int, ok: bool) -> None:
        """Note the latest work that ran in this turn (see LatestGrant.ran): its release
        records it in the key's line file before it hands the key on."""
        self._place.ran = Ran(called, ok)

    def _forget(self) -> None:
        """(In a forked child.) End the child's part of its parent's grant, touching nothing.

        The ticket is the parent's: the parent holds the key until it leaves
        its own block, and hands it on then. The child's copy of the ticket
        was closed at the fork (see _fds), and its number may name another
        file of the child's since.
        """
        self._place.fd = -1

    def __repr__(self) -> str:
        held = (
            "released" if self._place.fd < 0 else "held" if self._forks == forks() else "inherited"
        )
        return f"<FileGrant key={describe(self.key)} token={self.token} {held}>"


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
      skipped; nothing needs a lease or a clean-up to recover. A process
      killed at any instruction of queueing, releasing or tidying leaves
      every line usable and loses nobody's turn; what it leaves behind is
      removed by the next turn that tidies the key's line.
    - Forks: a child forked while its parent holds a key (or waits for it)
      closes its copies of the turn's files at once, so the parent's line
      never waits for the child. Leaving the block in the child ends the
      child's part of the turn at once, with no effect on the parent's
      files: the parent holds the key until it leaves its own block. The
      child may then take the key again, behind the parent, as any process.
    - Waiting costs no CPU and never blocks the event loop: a waiter sleeps
      in the loop until the ticket before it hands the key on, or the
      kernel reports that it closed. Timeouts and cancellation take effect
      at once, and no thread is ever left waiting. The only other wait is
      for a line file's lock, held for a few system calls: a process frozen
      inside them (SIGSTOP, a debugger) delays the others, who give up at
      their deadline.
    - File descriptors: a key held costs one (its ticket), a key waited for
      two, while it waits. A turn that finds no descriptor left (the
      process's ``RLIMIT_NOFILE``, or the system's table) is refused with
      :exc:`~inturn.BackendUnavailable`: its work does not run, and nothing
      it made stays in the directory.
    - Files are named by a digest of the key, so any ``str``, ``bytes`` or
      ``int`` key is safe, however long and whatever it contains. A line's
      files are deleted by its last holder (tickets of crashed processes by
      the next holder of that key).

    Not guaranteed: fairness beyond arrival order; exclusion between hosts
    sharing a network file system (use the Redis backend across hosts); and
    fencing tokens that survive the wall clock being set back while a key is
    idle.

    What it trusts: the directory is its own. Another process of this user
    that deletes, replaces or edits the files of a busy line can let two
    processes hold its key at once. A holder whose line file or ticket was
    deleted or replaced finds out (``turn.lease_lost``, then
    :exc:`~inturn.LeaseLost`); a line file edited in place goes unnoticed.

    Shared directories: a directory that others may write to is refused,
    unless it has the sticky bit (as ``/tmp`` has); the files then go to
    ``inturn-<uid>``, an owner-only subdirectory of this user's in it. No
    file is ever opened through a symbolic link. If the directory is
    removed, the next turn makes it again, with the same checks.

    :param directory: where the line files live, created owner-only (mode
        0700) if missing. Every process that shares the lines must use the
        same directory. Default: ``inturn-<uid>`` in ``/dev/shm`` on Linux (a
        file system in memory: a turn on a free key takes about 0.7 of its
        time on ext4; every process of the host, or of the container, that
        takes the default shares it), else in the system's temporary
        directory. It is made and checked at its first use (the first turn,
        :attr:`directory`, :meth:`line` or :meth:`lines`), not here: a queue
        made at import time touches no file. Its refusal then raises from
        that use, naming the directory and the fix: ``PermissionError`` (it
        belongs to another user, is a symbolic link, or may be written by
        others and has no sticky bit), ``NotADirectoryError`` (the path is
        not a directory), or another ``OSError`` (it cannot be created).
    :raises RuntimeError: the platform is not POSIX.
    """

    __slots__ = ("_home",)

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        _check_platform()
        path = _default_directory() if directory is None else Path(directory)
        self._home = Home(path.absolute())  # found again, with the same checks, if removed

    @property
    def directory(self) -> Path:
        """The directory holding the line files (``inturn-<uid>`` in a sticky one).

        Asking makes and checks the directory if no turn has yet (see the
        class's ``directory`` parameter for what it raises).
        """
        return self._home.where.path

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Sort keys into the order every process computes (by their portable names).

        :raises TypeError: a key is not a ``str``, ``bytes`` or ``int``.
        """
        return order_portable(keys)

    def _failed(self, key: Hashable, error: BaseException, doing: str) -> None:
        """Log an error of the file system (permissions, a full disk...) that a call on key raises.

        Not a missed deadline: that TimeoutError is the caller's to handle.
        """
        if isinstance(error, OSError) and not isinstance(error, TimeoutError):
            logger.warning(
                "inturn: could not %s key %s in %s: %s", doing, describe(key), self.directory, error
            )

    def _not_taken(self, key: Hashable, error: BaseException) -> None:
        """Log why a turn on key was not taken (see _failed).

        :raises ~inturn.BackendUnavailable: from error, which says that no
            file descriptor was left, or that the directory's file system takes
            no write: full, read-only, ... (see _limits).
        """
        self._failed(key, error, "take a turn on")
        # (while the directory is not found, its own OSError says what to fix: see Home)
        refused = refusal(key, self._home.shown, error, writing=self._home.found)
        if refused is not None:
            raise refused from error

    def acquire(self, key: Hashable, timeout: float | None) -> Coroutine[Any, Any, FileGrant]:
        """Queue in key's line file and wait until every ticket before ours has left.

        Waits in the event loop: for the ticket before ours (a reader of the
        loop), or, rarely, for the line file's lock (on the loop's timer).

        :raises TimeoutError: the turn was not reached within ``timeout``;
            this process's ticket left the line.
        :raises ~inturn.BackendUnavailable: no file descriptor was left, or
            the directory could not be written (a full disk or quota, a
            read-only file system, no permission, an I/O error); its cause is
            the OSError, and the work did not run.
        :raises OSError: the directory, made at the first turn, was refused
            or could not be made (see the class's ``directory`` parameter).
        """
        # (the coroutine of _driven itself, with no frame of its own around it: a task's turn
        # takes this on its way in, and acquire_latest shares _driven)
        return self._driven(taking(self._home, key, FileGrant), key, timeout)

    async def _driven(
        self, steps: Taking[FileGrant], key: Hashable, timeout: float | None
    ) -> FileGrant:
        """The grant the steps of a task's turn on key take, within timeout."""
        loop = asyncio.get_running_loop()
        try:
            grant = await drive(steps, key, timeout)
        except BaseException as error:
            steps.close()  # leave the line (see _line.taking)
            self._not_taken(key, error)
            raise
        grant._loop = loop
        return grant

    def _driven_sync(
        self, steps: Taking[FileGrant], key: Hashable, timeout: float | None
    ) -> FileGrant:
        """As _driven, for a thread's turn, blocking it."""
        try:
            return drive_blocking(steps, key, timeout)
        except BaseException as error:
            steps.close()  # leave the line (see _line.taking)
            self._not_taken(key, error)
            raise

    #: Threads block in the kernel on their tickets; latest work is kept per key among
    #: every process (see Capabilities).
    capabilities: Final[Capabilities] = Capabilities(blocking=True, latest=True)

    def thread_loop(self) -> None:
        """None: a thread's turn blocks in the kernel, on no event loop."""
        return

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> FileGrant:
        """As :meth:`acquire`, blocking this thread while it waits; it needs no event loop.

        The kernel does the waiting: the thread sleeps in ``poll()`` on the
        ticket before ours until it leaves or the deadline comes. (The rare
        wait for a line file's lock that stays taken sleeps between tries,
        as :meth:`acquire` does on its loop's timer.) Any number of threads,
        and event loops, may use one backend at once; turns of threads and
        of tasks, of this and every other process, go in one arrival order.

        An exception that a signal handler raises while the thread waits
        (``KeyboardInterrupt``; ``SystemExit`` from a server's handler)
        propagates, and this process's ticket leaves the line, as at a timeout.

        ``into``: see :meth:`inturn.backends.BlockingBackend.acquire_sync`.

        :raises TimeoutError: the turn was not reached within ``timeout``;
            this process's ticket left the line.
        :raises ~inturn.BackendUnavailable: as :meth:`acquire`.
        """
        return self._driven_sync(taking(self._home, key, FileGrant, into), key, timeout)

    def acquire_latest(
        self, key: Hashable, timeout: float | None, newest: Newest
    ) -> Coroutine[Any, Any, FileGrant]:
        """As :meth:`acquire`, for a process's latest work on key (``across="processes"``).

        The ticket carries a post of when the process's newest work was called
        (``newest()``); once its turn comes, it runs only if no newer work waits
        in the line or ran since (see :class:`~inturn.backends.LatestBackend`).

        :raises ~inturn.backends.Replaced: newer work of another process ran
            in its place; the key is not held.
        :raises TimeoutError: as :meth:`acquire`, also while it waits again
            behind newer work.
        """
        return self._driven(taking(self._home, key, FileGrant, None, newest), key, timeout)

    def acquire_latest_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest,
        into: list[Grant] | None = None,
    ) -> FileGrant:
        """As :meth:`acquire_latest`, blocking this thread (see :meth:`acquire_sync`)."""
        return self._driven_sync(taking(self._home, key, FileGrant, into, newest), key, timeout)

    def release(self, grant: Grant) -> Awaitable[None]:
        """Hand the key on (close grant's ticket), then tidy the line file up.

        Done at once, in a few system calls: the answer is a finished Future,
        unless the grant left its line last and another process held the
        line file's lock; it then completes once the tidy was tried again
        (see _tidy.retry). The key is handed on at once either way.

        In a forked child, a grant its parent holds ends in the child alone,
        with no effect on the parent's files (see FileGrant._forget): the
        Future is done already, and is of the loop the grant was taken in
        (the child of a task has no running loop).
        """
        own = self._granted(grant)
        if own._forks != forks():
            own._forget()
            done = (own._loop or asyncio.get_running_loop()).create_future()
            done.set_result(None)
            return done
        done = asyncio.get_running_loop().create_future()
        again = self._leave(own)
        if again is not None:
            retry(done, *again)  # at once, then 1 ms...
            return done
        done.set_result(None)
        return done

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`release`, from a thread with no event loop: returns once the key was handed on.

        If the grant left its line last and another process held the line
        file's lock, the tidy is tried again as :meth:`release` tries it, for
        half a second at most, on a thread of its own (a daemon, started for
        that): a thread has no loop to come back on later, and neither its
        user's work nor its next turn is held up for a tidy. The line file is
        then left to the key's next turn, which removes it.
        In a forked child, a grant its parent holds ends as in :meth:`release`.
        """
        own = self._granted(grant)
        if own._forks != forks():  # a forked child's copy of its parent's grant
            own._forget()
            return
        again = self._leave(own)
        if again is not None:
            retry_aside(*again)

    def _granted(self, grant: Grant) -> FileGrant:
        if not isinstance(grant, FileGrant):
            raise TypeError(
                f"inturn: {self!r} cannot release {describe(grant)}, which it did not grant"
            )
        return grant

    def _leave(self, grant: FileGrant) -> tuple[Directory, str, str, Hashable] | None:
        """Hand grant's key on and tidy its line file (see _line.leave); log an error."""
        try:
            return leave(grant._place, grant.key, grant.token)
        except OSError as error:
            self._failed(grant.key, error, "release")
            raise

    def line(self, key: Hashable) -> tuple[int, ...]:
        """The process ids in key's line, in turn order, as the line file has them now.

        The first holds the key (or is being handed it); the rest wait. A
        process appears once per queue that waits for the key. For
        operators and tests: the answer may be stale by the time it returns.
        Takes no lock and nothing from a ticket: it never waits, and never
        disturbs the line.
        """
        return pids_in_line(self._home.where.fd, hashlib.sha256(portable_name(key)).hexdigest())

    async def lines(self) -> list[LineInfo]:
        """A snapshot of every line in the directory, from its files alone, sorted by key.

        Each line's key is as the user gave it; its holder (the first
        ticket still in line: it holds the key, or is being handed it) and
        its waiters in turn order, by process id. ``held_for`` counts from
        when the holder's turn began, ``waiting_for`` from when the waiter
        queued. Like :meth:`line`, it never waits and never disturbs a
        line. Left out: lines that nobody is in any more (what a crash
        left, for the key's next turn to remove), and a line whose file
        does not record its key (only one edited by another process).
        """
        return snapshots(self._home.where.fd)

    async def aclose(self) -> None:
        """Nothing to close: every grant's files are closed by its release."""

    def __repr__(self) -> str:
        return f"FileBackend({str(self._home.shown)!r})"
