"""The directory a FileBackend keeps its files in: found, checked and opened once, never by a link.

The rule, for the directory a user names:

- It is created, owner-only (mode 0700), if it is missing.
- A symbolic link, or anything but a directory, is refused.
- If only its owner may write to it, it must belong to this user, and it is
  used as it is.
- If others may write to it (group or other write permission), it is
  refused, unless it has the sticky bit (as ``/tmp`` has): others then
  cannot rename or delete what this user puts in it, and the files go to
  ``inturn-<uid>`` inside it, an owner-only subdirectory of this user's.

Every file is then opened relative to the directory's descriptor, never by
a path that a rename of a parent could redirect.
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from pathlib import Path
from typing import final

#: Write permission for the group or for others.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: Any permission for the group or for others.
_OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@final
class Directory:
    """An open directory that passed the checks: ``fd`` to open files in, ``path`` to name it.

    The descriptor is closed once the object is no longer used (nothing
    else may close it: grants that outlive a replaced Directory still use it).
    """

    __slots__ = ("__weakref__", "fd", "path")

    def __init__(self, fd: int, path: Path) -> None:
        #: The directory's descriptor (``dir_fd=`` of every call on its files).
        self.fd = fd
        #: Where it is, for messages and for finding it again.
        self.path = path
        weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, given: Path) -> Directory:
        """Find, check and open the directory for given (see the module's rule).

        :raises PermissionError: given (or the subdirectory it calls for) is a
            symbolic link, belongs to another user, or may be written by
            others without the sticky bit.
        :raises NotADirectoryError: given exists and is not a directory.
        :raises OSError: given cannot be created or opened.
        """
        try:
            os.makedirs(given, mode=0o700, exist_ok=True)
        except FileExistsError:
            pass  # a file, or a link to nowhere: refused below
        except OSError as error:
            message = (
                f"inturn: cannot create the directory {given} for lines: {error}; create "
                "it before the workers start (owned by the user they run as, mode 700), "
                "or give FileBackend a directory this user may create"
            )
            raise OSError(error.errno, message) from None
        fd = _open_directory(given)
        try:
            info = os.fstat(fd)
            if info.st_mode & _OTHERS_WRITE:
                _check_sticky(given, info)
                own = _own_subdirectory(fd, given)
            else:
                _check_owner(given, info)
        except BaseException:
            os.close(fd)
            raise
        if not info.st_mode & _OTHERS_WRITE:
            return cls(fd, given)
        os.close(fd)
        return cls(own, given / _subdirectory_name())

    def gone(self) -> bool:
        """Whether the directory was deleted since it was opened."""
        return os.fstat(self.fd).st_nlink == 0

    def __repr__(self) -> str:
        return f"<Directory {str(self.path)!r} fd={self.fd}>"


def _subdirectory_name() -> str:
    return f"inturn-{os.geteuid()}"


def _open_directory(path: Path, parent: int | None = None) -> int:
    """Open the directory at path (relative to parent, a descriptor) without following a link."""
    name = path if parent is None else path.name
    try:
        return os.open(name, _OPEN_DIRECTORY, dir_fd=parent)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, parent):
            raise PermissionError(
                f"inturn: {path} is a symbolic link; give FileBackend the real directory "
                f"({os.path.realpath(path)}), so nobody can swap the link"
            ) from None
        if isinstance(error, NotADirectoryError):
            raise NotADirectoryError(f"inturn: {path} exists and is not a directory") from None
        raise OSError(
            error.errno,
            f"inturn: cannot use the directory {path} for lines: {error}; give FileBackend "
            "a directory that the user the workers run as owns and may read and write",
        ) from None


def _is_link(name: str | Path, parent: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _check_sticky(path: Path, info: os.stat_result) -> None:
    if not info.st_mode & stat.S_ISVTX:
        raise PermissionError(
            f"inturn: {path} is writable by others (mode {stat.filemode(info.st_mode)}) "
            "and has no sticky bit, so anyone may replace the files in it; use a "
            "directory only its owner may write, or a sticky one such as /tmp"
        )


def _check_owner(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.geteuid():
        raise PermissionError(
            f"inturn: {path} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}); whoever owns it could break or fake the lines. "
            "Use a directory of your own"
        )


def _own_subdirectory(parent: int, parent_path: Path) -> int:
    """Open (making it if missing) this user's owner-only subdirectory of a sticky directory."""
    path = parent_path / _subdirectory_name()
    try:
        os.mkdir(path.name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass  # ours from before, or someone else's: checked below
    except OSError as error:
        message = f"inturn: cannot create {path} for lines: {error}"
        raise OSError(error.errno, message) from None
    fd = _open_directory(path, parent)
    try:
        _check_private(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_private(path: Path, info: os.stat_result) -> None:
    _check_owner(path, info)
    if info.st_mode & _OTHERS_ANY:
        raise PermissionError(
            f"inturn: {path} may be used by others (mode {stat.filemode(info.st_mode)}); "
            "make it owner-only (chmod 700) or remove it"
        )
