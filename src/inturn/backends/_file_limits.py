"""What the file backend's turns cost in file descriptors, and the refusal when none is left.

A turn keeps one descriptor while it holds its key: its ticket's writer
end (see ``file.py``). While it waits, it keeps a second one, on the
ticket before its own; while it joins a line or tidies it, one for the
line file, for a few system calls. A process at its limit of open files
(``RLIMIT_NOFILE``, or the system's table of them) cannot take a turn: it
is refused with :exc:`~inturn.BackendUnavailable`, having left nothing in
the directory.
"""

from __future__ import annotations

import errno
from collections.abc import Hashable
from pathlib import Path

from .._describe import describe
from .._errors import BackendUnavailable

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


def out_of_files(key: Hashable, directory: Path, error: BaseException) -> BackendUnavailable | None:
    """The refusal of key's turn if error says no descriptor was left, else None.

    Its cause is error (the caller raises it ``from error``).
    """
    if not isinstance(error, OSError) or error.errno not in _WHY:
        return None
    why, fix = _WHY[error.errno]
    return BackendUnavailable(
        f"inturn: the file backend in {directory} could not take the turn on key "
        f"{describe(key)}: {why} (a key held through it keeps one open, a key waited "
        f"for two); the work did not run. To fix: {fix}, or hold fewer keys at once"
    )
