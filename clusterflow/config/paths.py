"""Checks of one path or URL that a key names, before anything is written there: a local folder
that can be made and written in, or a URL whose fsspec protocol is known and installed. Each
refusal is one line naming the key (``run.dir``, or a command's argument such as ``OUT``), the
value and the fix. Used by the run's preflight (``rundir/preflight.py``), the export and the shard
writer; they write nothing.
"""

from __future__ import annotations

import os
import re

import fsspec

from clusterflow.config.values import short
from clusterflow.errors import UserError

_KERNEL = ("/proc", "/sys", "/dev")


def check_local_dir(key: str, path: str) -> None:
    """``path`` is, or can be created as, a directory that this user can write files in."""
    long = [part for part in path.split("/") if len(os.fsencode(part)) > 255]
    if long or len(os.fsencode(path)) > 4000:
        raise UserError(
            f"{key} = {short(path)!r}: a path, or a folder name in it, is longer than the "
            "filesystem allows (255 bytes a name, 4096 a path); pick a shorter one"
        )
    real = os.path.realpath(path)
    for top in _KERNEL:
        if (real == top or real.startswith(top + "/")) and not real.startswith("/dev/shm"):
            raise UserError(
                f"{key} = {path!r} is under {top}, a kernel filesystem that holds no files; "
                f"pick a directory on a shared filesystem, e.g. {key}=runs/exp1"
            )
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        if os.path.islink(probe):
            raise UserError(
                f"{key} = {path!r}: {probe!r} is a symbolic link to {os.readlink(probe)!r}, "
                "which does not exist; fix or remove the link, or pick another path"
            )
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = (
            "is a file"
            if probe == os.path.abspath(path)
            else f"lies under {probe!r}, which is a file"
        )
        raise UserError(
            f"{key} = {path!r} {where}, not a directory; pick another path, or move the file away"
        )
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise UserError(
            f"{key} = {path!r}: {probe!r} is on a read-only filesystem; "
            f"pick a directory on a writable shared filesystem"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"{key} = {path!r}: this user may not write in {probe!r} (permission denied); "
            f"pick a directory you can write to"
        )


def check_backend(key: str, url: str) -> None:
    """fsspec can open ``url``: its protocol is known and the package behind it is installed."""
    for part in url.split("::"):
        protocol, _ = fsspec.core.split_protocol(part)
        if not protocol or protocol == "file":
            continue
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            named = re.search(r"install (\w[\w.-]*)", str(exc), re.IGNORECASE)
            fix = f"pip install {named.group(1)}" if named else "install what it names"
            raise UserError(
                f"{key} = {url!r}: fsspec cannot open {protocol}:// here ({exc}); {fix} in the "
                f"environment of the job (the login node and the compute nodes)"
            ) from None
        except ValueError:
            raise UserError(
                f"{key} = {url!r}: fsspec knows no protocol {protocol!r}; "
                "use a path or a URL such as s3://bucket/prefix or gs://bucket/prefix"
            ) from None
