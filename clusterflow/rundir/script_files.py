"""The files a script of the user's own names in its arguments (``--config cfg.yaml``,
``config/train_gpt2.py``, ``--init=weights.pt``, ``data=train.bin``): part of the run's identity,
like its config.

A word of ``script.args`` names a file when it is, or when its value after ``=`` is
(``--name=VALUE``, ``name=VALUE``), the path of an existing regular file of at most
:data:`MAX_BYTES`; a relative path is taken from the working directory, the one the job runs in
too (docs/own-loop.md#files-the-script-reads). Larger files (datasets, weights) are left out: a
dataset's identity is its length and its ``data_digest()`` (docs/data.md).

When a run starts (``saved_config.load_script`` for ``submit --script`` and ``run --script``,
``job/script.by_hand`` for a script started by hand) each such file is recorded in
``script.files`` with a digest of its bytes. Every later launch and every attempt of the run
(a resubmission, a requeue, a restart inside the allocation: ``saved_config.resolve``) reads the
files again and refuses to go on, naming the file, once one of them differs: the rest of the run
would otherwise train on another input than its first part, and say "same config". Refusing is
the rule of a changed config (``config.check_resume``); the files are not copied (the code is:
``frozen_code.py``), so the script keeps reading the paths it was given. No torch here: the login
node records them.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping

from clusterflow.errors import UserError

MAX_BYTES = 16 * 2**20
# Hex digits of a file's sha256 kept in script.files: 64 bits tell an edit apart.
DIGEST_CHARS = 16
# What script.files says of a recorded file that is gone or no longer a readable regular file.
GONE = "missing"


def candidates(args: list[str] | tuple[str, ...]) -> list[str]:
    """The words of ``args`` that may be paths: each word that is no option, and the value of
    each ``--name=VALUE`` or ``name=VALUE``; in order, each once (a word that is no string, which
    the config refuses later, is none)."""
    out: list[str] = []
    for word in args:
        if not isinstance(word, str):
            continue
        if "=" in word:
            word = word.split("=", 1)[1]
        elif word.startswith("-"):
            continue
        if word and word not in out:
            out.append(word)
    return out


def digest(path: str) -> str | None:
    """The digest of the regular file at ``path`` (``DIGEST_CHARS`` hex digits of its sha256),
    or None for anything else: no such path, a folder, a FIFO or device, a file this user cannot
    read, or one larger than ``MAX_BYTES``."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return None
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()[:DIGEST_CHARS]
    except (OSError, ValueError):  # ValueError: a path with a NUL byte
        return None


def named(args: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``{path as written: digest}`` of the files ``args`` name."""
    out = {}
    for word in candidates(args):
        seen = digest(word)
        if seen is not None:
            out[word] = seen
    return out


def changed(files: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``(path, recorded digest, digest now or GONE)`` of each recorded file that differs now."""
    out = []
    for path, recorded in files.items():
        now = digest(path) or GONE
        if now != recorded:
            out.append((path, recorded, now))
    return out


def refuse_changed(files: Mapping[str, str], run_dir: str) -> None:
    """UserError naming the first recorded file that changed since the run of ``run_dir``
    started, and what to do; nothing when none did."""
    found = changed(files)
    if not found:
        return
    path, recorded, now = found[0]
    where = "" if os.path.isabs(path) else f" (looked in {os.getcwd()})"
    became = "is gone" + where if now == GONE else f"changed (digest {recorded} -> {now})"
    more = f"; {len(found) - 1} more file(s) named there changed too" if len(found) > 1 else ""
    raise UserError(
        f"{path}, a file named in the script's arguments, {became} since run dir {run_dir!r} "
        f"started{more}: the rest of the run would train on another input than its first part; "
        f"put the file back as it was to resume this run, or start a new run with "
        f"run.dir=<new path> (docs/own-loop.md#files-the-script-reads)"
    )
