"""Reading a file from a folder that other hands write into (a run dir, a checkpoint store): the
one way every reader of a run's records opens a file.

A run dir is written by jobs, by hand, by tools, and may be shared: any record in it may have
been replaced by a link to another user's file, a FIFO, a device or a socket. A reader that
followed the link would show another file's contents as the run's; one that opened a FIFO would
wait for a writer forever (the dashboard's poll thread, ``clusterflow status``). So a file is
read here only when it is, by the time it is opened:

- **inside its folder** (``within``: the run dir, the checkpoint store's root), reached from
  there one name at a time with ``O_NOFOLLOW``: no folder on the way and not the file itself is
  a symbolic link (the folder given may be one: it is the user's own path), and no ``..``;
- **a regular file**: anything else (a FIFO, a device, a socket, a folder) is refused from its
  ``lstat`` before it is opened, and again from the ``fstat`` of what was opened (it may have
  been swapped in between); opened with ``O_NONBLOCK``, so even a swap never blocks;
- **within a size** (:func:`read_bytes`' ``limit``), read once as it is then.

Everything refused raises :class:`Refused` (an ``OSError``, so a reader that treats any
unreadable file as damaged does so without a change), whose text says what the file is instead.
A file that does not exist raises ``FileNotFoundError`` as ``open`` does.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class Refused(OSError):
    """A file that is not read, and why (``why``: "is a FIFO (named pipe), not a regular file",
    to follow the file's name in a message)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(why)
        self.path, self.why = path, why

    def __str__(self) -> str:
        return f"{self.path} {self.why}"


class TooLarge(Refused):
    """A file larger than its reader's ``limit``."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        super().__init__(path, f"is {_mib(size)}, more than the {_mib(limit)} it may hold")
        self.size, self.limit = size, limit


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def _what(mode: int) -> str | None:
    """What a file of ``mode`` is when it is no regular file (None when it is one)."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "no regular file")


def _names(path: str, within: str) -> list[str]:
    """The names from ``within`` down to ``path`` (compared as written, ``..`` resolved
    lexically): Refused when ``path`` does not lie below ``within``."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(within))
    names = rel.split(os.sep)
    if rel == os.curdir or names[0] == os.pardir:
        raise Refused(path, f"is not inside {within}")
    return names


def open_file(path: str, within: str | None = None) -> BinaryIO:
    """``path`` opened for reading in binary, when it is a regular file reached from ``within``
    (by default the folder that holds it) without a link; Refused otherwise."""
    if within is None:
        within = os.path.dirname(path) or os.curdir
    names = _names(path, within)
    folder = os.open(within, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        for i, name in enumerate(names[:-1]):
            st = os.stat(name, dir_fd=folder, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                link = os.path.join(within, *names[: i + 1])
                raise Refused(path, f"is reached through a symbolic link ({link})")
            inner = os.open(name, _DIR_FLAGS, dir_fd=folder)
            os.close(folder)
            folder = inner
        name = names[-1]
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=folder)
            raise Refused(path, f"is a symbolic link (to {target}), not a file of its folder")
        kind = _what(st.st_mode)
        if kind is not None:
            raise Refused(path, f"is {kind}, not a regular file")
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=folder)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link or a socket swapped in
                raise Refused(path, "changed into a link or a socket as it was opened") from None
            raise
    finally:
        os.close(folder)
    kind = _what(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise Refused(path, f"is {kind}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str, within: str | None = None, limit: int = 64 * 2**20) -> bytes:
    """The whole of ``path`` (see :func:`open_file`); TooLarge when it holds more than
    ``limit`` bytes, which are then never read."""
    with open_file(path, within) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise TooLarge(path, size, limit)
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while it was read
        raise TooLarge(path, len(data), limit)
    return data
