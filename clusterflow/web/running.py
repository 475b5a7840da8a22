"""The dashboards this user runs on this host, for ``clusterflow dashboard --list``: a lost
address (its token) is found again without restarting the dashboard.

Each dashboard writes one file while it serves, ``<folder>/<host>-<pid>.json`` (its address
with the token, its PATHs, its process and when it started), and removes it when it stops. The
folder is ``$XDG_STATE_HOME/clusterflow/dashboards`` (``~/.local/state/...`` by default): made
``0700``, each file ``0600``, so only the user reads a token; a folder that others could read
(or that another user owns) is refused, not used. A home shared by many hosts holds their files
side by side: ``--list`` shows this host's only, and only those whose process still runs (the
pid and its start time, as the lease checks a process), and removes the others (a dashboard
ended by SIGKILL leaves its file behind).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
import uuid
from dataclasses import dataclass

from clusterflow.errors import UserError
from clusterflow.rundir import lease


def folder() -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(state, "clusterflow", "dashboards")


def _private_folder(path: str) -> str:
    """``path``, made if missing (0700), refused when another user owns it or others may read
    or enter it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UserError(
            f"{path} holds dashboard addresses with their tokens, but "
            + ("another user owns it" if st.st_uid != os.getuid() else "others may read it")
            + f" (mode {stat.S_IMODE(st.st_mode):o}); make it yours alone: chmod 700 {path}"
        )
    return path


@dataclass(frozen=True)
class Entry:
    url: str
    paths: list[str]
    pid: int
    pid_start: str | None
    host: str
    started_at: float
    file: str = ""


def register(url: str, paths: list[str]) -> str:
    """Write this dashboard's file (readable by the user only); returns its path."""
    here = _private_folder(folder())
    host = socket.gethostname()
    pid = os.getpid()
    record = {
        "url": url,
        "paths": paths,
        "pid": pid,
        "pid_start": lease.process_start(pid),
        "host": host,
        "started_at": time.time(),
    }
    target = os.path.join(here, f"{host}-{pid}.json")
    tmp = os.path.join(here, f".{host}-{pid}-{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, target)
    return target


def unregister(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _read(path: str) -> Entry | None:
    try:
        with open(path) as f:
            rec = json.load(f)
        return Entry(
            url=str(rec["url"]),
            paths=[str(p) for p in rec.get("paths") or []],
            pid=int(rec["pid"]),
            pid_start=rec.get("pid_start"),
            host=str(rec["host"]),
            started_at=float(rec.get("started_at") or 0),
            file=path,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running() -> list[Entry]:
    """This host's dashboards whose process still runs, oldest first; the files of those gone
    are removed."""
    here = folder()
    if not os.path.isdir(here):
        return []
    _private_folder(here)
    host = socket.gethostname()
    out = []
    for name in sorted(os.listdir(here)):
        if not (name.startswith(f"{host}-") and name.endswith(".json")):
            continue
        entry = _read(os.path.join(here, name))
        if entry is None or entry.host != host:
            continue
        if entry.pid_start is None or lease.process_start(entry.pid) != entry.pid_start:
            unregister(entry.file)  # its process is gone
            continue
        out.append(entry)
    return sorted(out, key=lambda e: e.started_at)


def render(entries: list[Entry]) -> str:
    if not entries:
        return (
            f"no dashboard of yours runs on {socket.gethostname()} "
            "(start one: python -m clusterflow.dashboard PATH)"
        )
    lines = []
    for e in entries:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.started_at))
        lines.append(f"{e.url}  (pid {e.pid}, since {since}: {', '.join(e.paths)})")
    return "\n".join(lines)
