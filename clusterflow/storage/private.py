"""Folders only this user may enter, on a node that other users share.

``checkpoint.memory_dir`` is ``/dev/shm`` by default, where every user of the node may create
anything: a folder found there under the run's name may be a stranger's, made first to be used
as found (their snapshot planted in it, the run's moved aside), or open to every user. So a
folder of the run's there is used only when it is *private*:

- made by the run with exclusive creation (``mkdir`` fails when the name exists) and mode 0700
  set explicitly on the opened folder (the umask has no say), or, found, one that is a folder
  (not a link to one), owned by this process's effective user and open to nobody else (no group
  or other bit): :func:`make`, :func:`check`;
- below a folder whose entries nobody else can move: every folder from ``/`` down to it is
  owned by root or this user and writable by nobody else, unless sticky (``/dev/shm``'s 1777:
  others may add their own entries, never move ours): :func:`reach`. Each is opened from its
  parent with ``O_NOFOLLOW`` and judged from the ``fstat`` of what was opened, so a link or
  another folder swapped in on the way is refused, not followed; once the way is sound, nobody
  but root and this user can change what a path below it names.

Everything refused raises :class:`Unsafe` (an ``OSError``) whose text names the folder and why.
Nothing here reads or writes inside a folder it refused.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

FOLDER_MODE = 0o700  # a private folder's mode
FILE_MODE = 0o600  # a private file's mode (``durable.open_new``)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Unsafe(OSError):
    """A folder that is never read or written, and why (``why``: to follow its path)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(why)
        self.path, self.why = path, why

    def __str__(self) -> str:
        return f"{self.path} {self.why}"


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _open(path: str, name: str | None = None, dir_fd: int | None = None) -> int:
    """``name`` in ``dir_fd`` (or ``path``) opened as a folder, never through a link."""
    try:
        return os.open(path if name is None else name, _DIR, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Unsafe(path, "is a symbolic link or no folder") from None
        raise


def _judge(path: str, st: os.stat_result) -> None:
    """Unsafe unless ``st`` is a folder of this user's that others cannot enter."""
    me = os.geteuid()
    if st.st_uid != me:
        raise Unsafe(path, f"belongs to {_user(st.st_uid)}, not to this job's {_user(me)}")
    if st.st_mode & 0o077:
        raise Unsafe(
            path, f"is open to other users (mode {stat.S_IMODE(st.st_mode):04o}, not 0700)"
        )


def check(path: str) -> None:
    """Unsafe unless ``path`` is a private folder (see the module's docstring)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise Unsafe(path, "is gone") from None
    if stat.S_ISLNK(st.st_mode):
        raise Unsafe(path, f"is a symbolic link (to {os.readlink(path)}), not a folder")
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(path, "is no folder")
    fd = _open(path)
    try:
        opened = os.fstat(fd)
    finally:
        os.close(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        raise Unsafe(path, "was replaced while it was checked")
    _judge(path, opened)


def is_private(path: str) -> bool:
    """Whether ``path`` is a private folder, from its ``lstat`` (for the entries of a folder
    already checked private, which nobody else can replace)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def make(path: str) -> bool:
    """Create the private folder ``path`` (its parent must be sound: :func:`reach`); when the
    name exists, use it only if it is private. True when this call made it; Unsafe otherwise."""
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        check(path)
        return False
    fd = _open(path)
    try:
        os.fchmod(fd, FOLDER_MODE)
        _judge(path, os.fstat(fd))
    finally:
        os.close(fd)
    return True


def reach(folder: str, create: bool = True) -> str | None:
    """``folder`` resolved (no link in it), when every folder from ``/`` down to it is one
    that nobody but root and this user can change: owned by root or this user, writable by
    nobody else unless sticky; Unsafe naming the first that is not. ``create``: the missing
    folders on the way are made private (:func:`make`); else None when one is missing."""
    real = os.path.realpath(folder)
    fd = _open("/")
    try:
        _shared_ok("/", os.fstat(fd))
        here = "/"
        for name in [p for p in real.split("/") if p]:
            here = os.path.join(here, name)
            try:
                inner = _open(here, name, fd)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    os.mkdir(name, FOLDER_MODE, dir_fd=fd)
                    inner = _open(here, name, fd)
                    os.fchmod(inner, FOLDER_MODE)
                except FileExistsError:  # made meanwhile, by a sibling rank or someone else
                    inner = _open(here, name, fd)
            os.close(fd)
            fd = inner
            _shared_ok(here, os.fstat(fd))
    finally:
        os.close(fd)
    return real


def _shared_ok(path: str, st: os.stat_result) -> None:
    """Unsafe unless nobody but root and this user can move the entries of folder ``path``."""
    if st.st_uid not in (0, os.geteuid()):
        raise Unsafe(
            path,
            f"belongs to {_user(st.st_uid)}, who could move the run's folders in it aside",
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Unsafe(
            path,
            f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}, without the "
            "sticky bit /dev/shm has): they could move the run's folders in it aside",
        )
