"""What the file backend's turns need of the system, and the refusal when it is not there.

A turn keeps one descriptor while it holds its key: its ticket's writer
end (see ``__init__.py``). While it waits, it keeps a second one, on the
ticket before its own; while it joins a line or tidies it, one for the
line file, for a few system calls. A process at its limit of open files
(``RLIMIT_NOFILE``, or the system's table of them) cannot take a turn: it
is refused with :exc:`~inturn.BackendUnavailable`, having left nothing in
the directory. So is a turn whose line file or ticket cannot be written:
a full disk, a quota used up, a read-only file system, a directory this
process may not write in, an I/O error.
"""

from __future__ import annotations

import errno
from collections.abc import Hashable
from pathlib import Path

from ..._describe import describe
from ..._errors import BackendUnavailable

#: What open() says when no descriptor is left, and why, and the fix.
_WHY = {
    errno.EMFILE: (
        "this process has no file descriptor left",
        "raise its limit (`ulimit -n`, or resource.setrlimit(RLIMIT_NOFILE, ...))",
    ),
    errno.ENFILE: (
        "the system's table of open files is full",
        "raise the system's limit (sysctl fs.file-max), or close files elsewhere",
    ),
}


#: What a write to the directory says when the file system will not take it, and the fix.
_CANNOT_WRITE = {
    errno.ENOSPC: "free space on its file system",
    errno.EDQUOT: "free space within this user's quota, or raise it",
    errno.EROFS: "mount its file system read-write, or give the backend a writable directory",
    errno.EACCES: "let this process's user write in it (its owner and mode)",
    errno.EPERM: "let this process's user write in it (its owner, mode and attributes)",
    errno.EIO: "check the disk and the file system (dmesg)",
}


def refusal(
    key: Hashable, directory: Path, error: BaseException, writing: bool = True
) -> BackendUnavailable | None:
    """The refusal of key's turn if error says the system would not serve it (no descriptor
    left; with ``writing``, a file system that takes no write), else None.

    Its cause is error (the caller raises it ``from error``).
    """
    if not isinstance(error, OSError) or isinstance(error, TimeoutError):
        return None
    refused = (
        f"inturn: the file backend in {directory} could not take the turn on key {describe(key)}"
    )
    if error.errno in _WHY:
        why, fix = _WHY[error.errno]
        return BackendUnavailable(
            f"{refused}: {why} (a key held through it keeps one open, a key waited "
            f"for two); the work did not run. To fix: {fix}, or hold fewer keys at once"
        )
    to_write = _CANNOT_WRITE.get(error.errno or 0)
    if to_write is None or not writing:
        return None
    cause = error.strerror or str(error)
    return BackendUnavailable(
        f"{refused}: it could not write there ({cause}); the work did not run. To fix: {to_write}"
    )
