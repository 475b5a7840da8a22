"""The small JSON records of a run dir that ``status`` reads: status.json (updated under a lock
across processes), attempts.jsonl, stops.jsonl, errors/rank<R>.json; readers that survive a
damaged or half-written record."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from typing import Any, Iterator

from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import durable


def read_json(target: str, default: Any = None) -> Any:
    """The JSON in ``target``, or ``default`` when it is missing or damaged (not JSON, not UTF-8,
    a folder)."""
    try:
        with open(target, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):  # ValueError: JSONDecodeError and UnicodeDecodeError
        return default


def read_object(target: str) -> tuple[dict[str, Any], str]:
    """A JSON object record (status.json): (record, "") or, when it is damaged, ({}, what is wrong);
    ({}, "") when it does not exist. A damaged record never stops a run or `status`."""
    if not os.path.exists(target):
        return {}, ""
    rec = read_json(target, _DAMAGED)
    if rec is _DAMAGED:
        return {}, f"{os.path.basename(target)} is not readable JSON"
    if not isinstance(rec, dict):
        return {}, f"{os.path.basename(target)} holds a JSON {type(rec).__name__}, not an object"
    return rec, ""


_DAMAGED = object()


def read_jsonl(target: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; lines that are not one (cut by a kill mid-write,
    garbage bytes, another type) are skipped: the rest is still good."""
    out = []
    try:
        with open(target, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line.decode("utf-8")) if line.strip() else None
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except FileNotFoundError:
        pass
    except OSError:
        pass  # a folder where the file should be: nothing readable
    return out


def open_jsonl(target: str) -> Any:
    """Open a JSON-lines file for appending. A line left unfinished by a killed writer is closed
    first, so it cannot swallow the next record."""
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    f = open(target, "a+b")
    if f.tell() > 0:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
    return f


def append_jsonl(target: str, record: dict[str, Any]) -> None:
    with open_jsonl(target) as f:
        f.write((json.dumps(record, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def attempt_count(paths: RunPaths) -> int:
    """How many job starts (requeues included) attempts.jsonl records. Attempts are numbered
    from 0, so this is also the number the next attempt gets."""
    return len(read_jsonl(paths.attempts))


def current_attempt(paths: RunPaths) -> int:
    """The number of the newest attempt (0 before any): the one whose logs and first cause
    ``status`` and ``submit --local`` show."""
    return max(0, attempt_count(paths) - 1)


def record_attempt(paths: RunPaths, **fields: Any) -> int:
    """Append this job start to attempts.jsonl; returns its attempt number."""
    n = attempt_count(paths)
    append_jsonl(paths.attempts, {"attempt": n, "started_at": time.time(), **fields})
    return n


def record_stop(paths: RunPaths, **fields: Any) -> None:
    append_jsonl(paths.stops, fields)


def count_stops(paths: RunPaths, reason: str) -> int:
    return sum(1 for r in read_jsonl(paths.stops) if r.get("reason") == reason)


# The loop and the checkpoint writer's thread both update status.json.
_STATUS_LOCK = threading.Lock()


@contextlib.contextmanager
def _locked(target: str) -> Iterator[None]:
    """An exclusive lock across processes (``target``.lock, flock): two failing ranks and the
    --local watcher each read, update and replace status.json, and without it one of them can
    replace the file with a copy read before another's update (a lost cause or exit code). Where
    the filesystem has no locks, the update goes on without one."""
    try:
        fd = os.open(target + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_status(paths: RunPaths, fsync: bool = True, **fields: Any) -> None:
    """Update fields of status.json. ``fsync=False`` for the training loop's progress (step, loss,
    rate), where an fsync would cost milliseconds at log steps. A power loss right after such a
    write loses that line, and on a filesystem that may commit a rename before the data (not
    ext4's default) it can leave status.json empty: ``status`` then reports it as a damaged record
    and the next write replaces it; the checkpoints, the truth, are untouched."""
    with _STATUS_LOCK, _locked(paths.status):
        current, _ = read_object(paths.status)  # a damaged one is replaced, never a reason to stop
        current.update(fields, updated_at=time.time())
        durable.write_atomic(
            paths.status, json.dumps(current, indent=1, sort_keys=True), fsync=fsync
        )


def write_error(paths: RunPaths, rank: int, host: str, error: str, trace: str) -> None:
    record = {"rank": rank, "host": host, "error": error, "traceback": trace, "time": time.time()}
    durable.write_atomic(paths.error_file(rank), json.dumps(record, indent=1))
