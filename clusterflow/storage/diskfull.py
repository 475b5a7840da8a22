"""A full disk, said in one sentence instead of
``[enforce fail at inline_container.cc:672] unexpected pos``.

torch.save reports a failed write as that RuntimeError, with the ``OSError(ENOSPC)`` it hit as its
context; :func:`cause` finds it under any wrapping. The writer that hit it (the checkpoint store,
``durable.write_atomic``) removes its partial file first, then calls :func:`raise_if_full`, whose
:class:`~clusterflow.errors.RunFailed` the job records as its error (status ``failed``, exit 1, no
traceback): "no space left on /dev/sdb1 (mounted at /scratch) writing checkpoint step 40 to
/scratch/run/checkpoints/step-40 (it needs about 120 MB, 3.2 MB free)".
"""

from __future__ import annotations

import errno
import os
import re
import shutil

from clusterflow.errors import RunFailed

_FULL = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}


def cause(exc: BaseException | None) -> OSError | None:
    """The ENOSPC or EDQUOT error behind ``exc`` (itself, or what it was raised from or during)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# How a full disk reads in an error's text: this module's own sentences, and the OS's words.
_WORDS = (*_FULL.values(), "No space left on device", "Disk quota exceeded", "[Errno 28]")


def says_full(text: str) -> bool:
    """Whether an error's text (a failed rank's record) says the disk was full, in any words."""
    return any(words in text for words in _WORDS)


def payload_bytes(obj: object) -> int:
    """About how many bytes ``obj`` takes on disk: its tensors' and byte strings' sizes."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, (bytes, bytearray, memoryview, str)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def device_of(path: str) -> str:
    """The device a local path is on and where it is mounted, e.g. ``/dev/sdb1 (mounted at
    /scratch)``."""
    mount = _existing(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    source = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 1 and fields[1].replace("\\040", " ") == mount:
                    source = fields[0]  # the last mount on a point is the one in effect
    except OSError:
        pass
    return f"{source} (mounted at {mount})" if source else mount


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 10e6 else f"{n / 1e6:.0f} MB"


def describe(exc: BaseException, what: str, path: str, needed: int, local: bool = True) -> str:
    """The sentence for a full disk (or quota) behind ``exc``: the device, ``what`` was written,
    ``path``, the size and the free space; "" when ``exc`` does not come from one."""
    err = cause(exc)
    if err is None:
        return ""
    device, free = path, ""
    if local:
        device = device_of(path)
        try:
            free = f", {_mb(shutil.disk_usage(_existing(path)).free)} free"
        except OSError:
            pass
    return (
        f"{_FULL[err.errno]} on {device} writing {what} to {path} "
        f"(it needs about {_mb(needed)}{free})"
    )


# The sentence :func:`describe` writes, read back by the restart driver (``job/restarts.py``),
# which restarts a job that stopped on a full disk once the disk has room again.
_SENTENCE = re.compile(
    r"(?:no space left|disk quota exceeded) on .+? writing .+? to (?P<path>\S+) "
    r"\(it needs about (?P<mb>[\d.]+) MB"
)


def said_full(message: str) -> tuple[str, int] | None:
    """(the path, the bytes it needed) of a full disk that ``message`` names in
    :func:`describe`'s words; None for any other message."""
    m = _SENTENCE.search(message)
    return (m.group("path"), int(float(m.group("mb")) * 1e6)) if m else None


def free_bytes(path: str) -> int | None:
    """The bytes free on the filesystem that holds ``path`` (or the nearest folder above it that
    exists); None when that cannot be asked."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def raise_if_full(
    exc: BaseException, what: str, path: str, needed: int, local: bool = True
) -> None:
    """Raise a RunFailed naming the device, ``what`` was written, ``path``, the size and the free
    space, when ``exc`` comes from a full disk (or quota); return otherwise."""
    sentence = describe(exc, what, path, needed, local)
    if sentence:
        raise RunFailed(
            f"{sentence}; free space there and "
            "resubmit: the run resumes from its last committed checkpoint"
        ) from None
