"""The small JSON records of a run dir that ``status`` reads: status.json (written only by
``transitions.py``), attempts.jsonl, stops.jsonl, errors/rank<R>.json; readers that survive a
damaged or half-written record.

Every record has a declared schema here (field -> what it must be): a reader given one keeps the
fields that fit it and names each one that does not ("status.json: global_step is 'abc' (a str),
not an integer"), so that a record written by hand, by another version or by a torn write is a
named warning in ``status``'s ``damaged_records``, never a traceback. Records are hints; the
committed checkpoints are the truth.

Every reader here opens its file through ``storage/confined.py``: a record that is a link (or
lies in a folder that is one), a FIFO, a device or a socket is named and never read, so no
record resolves outside its run dir and none can block a reader."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from clusterflow.errors import RunFailed
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.states import STATES, StopReason
from clusterflow.storage import confined, durable

log = logging.getLogger("clusterflow.records")

# A record is kilobytes (status.json with every mining round's curve: well under a megabyte). A
# file far larger is no record (a runaway or hostile writer); reading it whole would cost its size
# in memory and seconds, so readers refuse it by its size.
MAX_RECORD_BYTES = 64 * 2**20
# A JSON line longer than this is skipped unread (a metrics row of a thousand GPUs is ~100 KB).
MAX_LINE_BYTES = 4 * 2**20

# -- schemas ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """What a field must be: ``what`` names it for the warning, ``test`` tells."""

    what: str
    test: Callable[[Any], bool]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _list_of(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(test(x) for x in v)


INT = Check("an integer", _is_int)
NUMBER = Check("a finite number", _is_number)
SECONDS = Check("a finite number of seconds >= 0", lambda v: _is_number(v) and v >= 0)
# Seconds since 1970 that time.localtime can show (a year up to about 5000).
TIME = Check("a time in seconds since 1970", lambda v: _is_number(v) and 0 <= v < 1e11)
RANKS = Check("a rank count from 1 to 1000000", lambda v: _is_int(v) and 0 < v <= 1_000_000)
TEXT = Check("a string", lambda v: isinstance(v, str))
FLAG = Check("true or false", lambda v: isinstance(v, bool))
OBJECT = Check("an object", lambda v: isinstance(v, dict))
TEXTS = Check("a list of strings", _list_of(lambda x: isinstance(x, str)))
JOB_ID = Check("a job id (string or integer)", lambda v: isinstance(v, str) or _is_int(v))
STATE = Check(f"one of {', '.join(STATES)}", lambda v: v in STATES)
PROCS = Check(
    "a list of [host, pid, start time]",
    _list_of(
        lambda p: (
            isinstance(p, list)
            and len(p) == 3
            and isinstance(p[0], str)
            and _is_int(p[1])
            and isinstance(p[2], str)
        )
    ),
)


@dataclass(frozen=True)
class Schema:
    """A record's fields that readers use (others are kept as they are) and the ones without
    which the record means nothing (it is then dropped whole)."""

    fields: Mapping[str, Check]
    required: tuple[str, ...] = field(default=())

    def fits(self, v: object) -> bool:
        return isinstance(v, dict) and not checked(v, self, "")[1]


def _curve_fits(v: object) -> bool:
    """A mining round's threshold curve: equally long lists, as status's summary reads them."""
    if not isinstance(v, dict) or not _list_of(_is_number)(v.get("thresholds")):
        return False
    n = len(v["thresholds"])
    return all(
        _list_of(test)(v.get(k)) and len(v[k]) == n
        for k, test in (("num_clusters", _is_int), ("largest_cluster", _is_int))
    ) and (v.get("nmi") is None or (_list_of(_is_number)(v["nmi"]) and len(v["nmi"]) == n))


MINING_ROUND = Schema(
    {
        "epoch": INT,
        "num_clusters": INT,
        "num_singletons": INT,
        "largest_cluster": INT,
        **{k: NUMBER for k in ("nmi", "ari", "pairwise_f", "bcubed_f", "threshold")},
        "method": TEXT,
        "threshold_rule": TEXT,
        "seconds": Check("an object of numbers", lambda v: isinstance(v, dict)),
        "curve": Check("a threshold curve (equally long lists)", _curve_fits),
    },
    required=("epoch", "num_clusters", "num_singletons", "largest_cluster"),
)

STATUS = Schema(
    {
        "state": STATE,
        "error": TEXT,
        "checkpoint_error": TEXT,
        "phase": TEXT,
        "job_id": JOB_ID,
        **{
            k: INT
            for k in (
                "epoch",
                "epochs",
                "global_step",
                "step_in_epoch",
                "steps_per_epoch",
                "max_steps",
                "attempt",
                "exit_code",
            )
        },
        **{k: NUMBER for k in ("last_loss", "samples_per_s", "steps_per_s")},
        "updated_at": TIME,
        "world_size": RANKS,
        "hosts": TEXTS,
        "eval": OBJECT,
        "mining": Check("a list of mining rounds", _list_of(MINING_ROUND.fits)),
    }
)


def _ledger_range(v: object) -> bool:
    return (
        isinstance(v, dict)
        and all(_is_int(v.get(k)) for k in ("start", "end", "attempt", "world_size", "batch_size"))
        and 0 <= v["start"] <= v["end"]
    )


def _step_range(v: object) -> bool:
    return (
        isinstance(v, dict)
        and all(_is_int(v.get(k)) for k in ("start", "end", "attempt", "world_size"))
        and 0 <= v["start"] <= v["end"]
    )


LEDGER_EPOCH = Schema(
    {
        "epoch": INT,
        "samples": INT,
        "digest": TEXT,
        "ranges": Check("a list of ranges", _list_of(_ledger_range)),
    },
    required=("epoch", "samples", "ranges"),
)
# RUN_DIR/sample_ledger.json (checkpoint/train_state.py's SampleLedger.record_file).
LEDGER = Schema(
    {
        "format": INT,
        "global_step": INT,
        "epochs": Check("a list of epochs", _list_of(LEDGER_EPOCH.fits)),
        # A loop without a loader: the steps each attempt trained.
        "steps": Check("a list of step ranges", _list_of(_step_range)),
    },
    required=("epochs",),
)
ATTEMPT = Schema(
    {
        "attempt": INT,
        "started_at": TIME,
        "process_started_at": TIME,
        "job_id": JOB_ID,
        "source": TEXT,
        "host": TEXT,
        "hosts": TEXTS,
        "world_size": RANKS,
        "restart_count": INT,
        "restart_in_job": INT,
        "procs": PROCS,
    }
)
SUBMISSION = Schema({"job_id": JOB_ID, "submitted_at": TIME}, required=("job_id",))
ERROR = Schema(
    {"rank": INT, "host": TEXT, "error": TEXT, "traceback": TEXT, "time": TIME},
    required=("rank", "error"),
)
FIRST_ERROR = Schema(
    {
        "rank": INT,
        "host": TEXT,
        "error": TEXT,
        "kind": TEXT,
        "time": TIME,
        "attempt": INT,
        "pid": INT,
        "step": INT,
        "phase": TEXT,
        "stalled_s": NUMBER,
        "where": TEXT,
        "silent_rank": INT,
        "silent_host": TEXT,
        "silent_s": NUMBER,
    },
    required=("rank", "error"),
)
HEARTBEAT = Schema(
    {
        "rank": INT,
        "host": TEXT,
        "pid": INT,
        "time": TIME,
        "step": INT,
        "phase": TEXT,
        "beats": INT,
        "progress_at": TIME,
        "step_time_s": NUMBER,
        "busy_s": NUMBER,
        "heartbeat_s": NUMBER,
        "paused_from": TIME,
        "paused_to": TIME,
        **{k: NUMBER for k in ("cpu_percent", "rss_bytes", "data_wait_fraction")},
        **{k: INT for k in ("gpu_index",)},
        "gpu_name": TEXT,
        **{
            k: NUMBER for k in ("gpu_mem_used_mb", "gpu_mem_total_mb", "gpu_util_pct", "gpu_temp_c")
        },
    },
    required=("rank",),
)
CODE_POINTER = Schema(
    {"module": TEXT, "script": TEXT, "version": TEXT, "git": OBJECT},
    required=("module", "version"),
)
LEASE = Schema(
    {
        "token": TEXT,
        "host": TEXT,
        "pid": INT,
        "pid_start": TEXT,
        "slurm_job": TEXT,
        "job_id": JOB_ID,
        "source": TEXT,
        "attempt": INT,
        "started_at": TIME,
        "renew_s": NUMBER,
    }
)


def _shown(v: object) -> str:
    text = json.dumps(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(v: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number"
    )


def checked(rec: object, schema: Schema, where: str) -> tuple[dict[str, Any] | None, list[str]]:
    """(the fields of ``rec`` that fit ``schema``, a warning per field that does not); (None,
    warnings) when ``rec`` is no object or lacks a required field. A null field counts as absent.
    ``where`` names the record in the warnings (a file, "attempts.jsonl line 3")."""
    if not isinstance(rec, dict):
        return None, [f"{where} holds a JSON {type(rec).__name__}, not an object"]
    out, warnings = {}, []
    for key, value in rec.items():
        check = schema.fields.get(key)
        if value is not None and check is not None and not check.test(value):
            warnings.append(f"{where}: {key} is {_shown(value)} ({_kind(value)}), not {check.what}")
            continue
        out[key] = value
    missing = [k for k in schema.required if out.get(k) is None]
    if missing:
        return None, warnings + [f"{where}: no valid {', '.join(missing)}; the record is ignored"]
    return out, warnings


def read_checked(
    target: str, schema: Schema, where: str | None = None, within: str | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """A JSON object record checked against ``schema``: (the record or None, warnings); (None,
    []) when the file does not exist. ``within``: the folder it must not lead out of (the run
    dir, for a record in one of its folders; by default the folder that holds it): a link, a
    FIFO or anything but a regular file there is named and not read (``storage/confined.py``)."""
    where = where or os.path.basename(target)
    try:
        data = confined.read_bytes(target, within, MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None, []
    except confined.TooLarge as exc:
        return None, [f"{where} {_too_large(exc.size)}; ignored"]
    except confined.Refused as exc:
        return None, [f"{where} {exc.why}"]
    except OSError:
        return None, [f"{where} is not readable JSON"]
    rec = _parse_line(data)
    if rec is _DAMAGED:
        return None, [f"{where} is not readable JSON"]
    return checked(rec, schema, where)


def _too_large(size: int) -> str:
    """What is wrong with a record file of ``size`` bytes, more than :data:`MAX_RECORD_BYTES`."""
    return f"is {size / 2**20:.0f} MiB, more than a record holds ({MAX_RECORD_BYTES // 2**20} MiB)"


def read_json(target: str, default: object = None, within: str | None = None) -> Any:
    """The JSON in ``target``, or ``default`` when it is missing or damaged (not JSON, not UTF-8,
    larger than :data:`MAX_RECORD_BYTES`, or refused as :func:`read_checked` refuses it)."""
    try:
        data = confined.read_bytes(target, within, MAX_RECORD_BYTES)
    except OSError:
        return default
    rec = _parse_line(data)
    return default if rec is _DAMAGED else rec


def read_object(
    target: str, schema: Schema | None = None, within: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """A JSON object record (status.json): (record, []) or, when it is damaged, ({}, what is
    wrong); ({}, []) when it does not exist. With ``schema``, only the fields that fit it, and a
    warning for each other one. A damaged record never stops a run or `status`."""
    rec, warnings = read_checked(target, schema or Schema({}), within=within)
    return rec or {}, warnings


_DAMAGED = object()


def _open_lines(target: str, within: str | None) -> tuple[BinaryIO | None, str]:
    """A JSON-lines file opened as :func:`read_checked` opens a record: (the file, "") or (None,
    why it is not read; "" when it does not exist or cannot be opened)."""
    try:
        return confined.open_file(target, within), ""
    except confined.Refused as exc:
        return None, exc.why
    except OSError:
        return None, ""


def read_records(
    target: str, schema: Schema, within: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a JSON-lines file checked against ``schema``, and warnings naming the
    lines and fields that do not fit (a line that is no JSON object is dropped: a kill mid-write
    cuts the last one; the rest is still good). ``within``: as :func:`read_checked`'s."""
    out, warnings, cut = [], [], []
    name = os.path.basename(target)
    f, refused = _open_lines(target, within)
    if f is None:
        return [], [f"{name} {refused}"] if refused else []
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_RECORD_BYTES:
            return [], [f"{name} {_too_large(size)}; ignored"]
        for n, rec in _lines(f):
            if rec is _DAMAGED:
                cut.append(str(n))
                continue
            good, said = checked(rec, schema, f"{name} line {n}")
            warnings += said
            if good is not None:
                out.append(good)
    if cut:
        shown = ", ".join(cut[:5]) + (", ..." if len(cut) > 5 else "")
        warnings.insert(0, f"{name}: {len(cut)} line(s) not JSON (line {shown})")
    return out, warnings


def _lines(f: BinaryIO) -> Iterator[tuple[int, Any]]:
    """(line number, its JSON or _DAMAGED) for each non-empty line of an open file. A line over
    :data:`MAX_LINE_BYTES` is _DAMAGED, and never held in memory whole; a read that fails ends
    the lines."""
    n = 0
    while True:
        try:
            line = f.readline(MAX_LINE_BYTES + 1)
        except OSError:
            return
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE_BYTES:
            _skip_line(f, line)
            yield n, _DAMAGED
            continue
        if line.strip():
            yield n, _parse_line(line)


def _skip_line(f: BinaryIO, start: bytes) -> None:
    """Read on to the end of a line too long to keep (``start``: what was read of it)."""
    chunk = start
    while chunk and not chunk.endswith(b"\n"):
        chunk = f.readline(MAX_LINE_BYTES)


def _parse_line(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return _DAMAGED


class JsonLinesFollower:
    """A JSON-lines file read on from where the last :meth:`read` stopped (a file that grows:
    metrics.jsonl while a run trains), never re-read whole.

    Each read returns the JSON objects of the lines completed since; a line still being written
    waits for its newline. At most ``chunk_bytes`` are read per call (``behind`` says more are
    waiting), so a huge file is taken in steps; a line over :data:`MAX_LINE_BYTES`, a line that
    is no JSON object, and garbage bytes are counted in ``damaged`` and skipped. A file that
    shrank or was replaced (another inode) is read again from its start: :meth:`read` then says
    ``restarted``, and the caller drops what it built from the old one.
    """

    def __init__(
        self, target: str, chunk_bytes: int = 4 * 2**20, within: str | None = None
    ) -> None:
        self.target, self.chunk_bytes, self.within = target, chunk_bytes, within
        self.refused = ""  # why the file is not read (a link, a FIFO: storage/confined.py)
        self.pos, self.inode = 0, None
        self.partial = b""
        self.skipping = False  # inside a line too long to keep
        self.damaged = 0
        self.behind = False

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """(the objects of the lines completed since the last read, whether the file was read
        again from its start)."""
        self.refused = ""
        try:
            with confined.open_file(self.target, self.within) as f:
                st = os.fstat(f.fileno())
                restarted = self.inode is not None and (
                    st.st_ino != self.inode or st.st_size < self.pos
                )
                if restarted or self.inode is None:
                    self.pos, self.partial, self.skipping = 0, b"", False
                self.inode = st.st_ino
                f.seek(self.pos)
                data = f.read(self.chunk_bytes)
                self.pos += len(data)
                self.behind = self.pos < st.st_size
        except confined.Refused as exc:
            self.behind, self.refused = False, exc.why
            return [], False
        except OSError:  # not there (yet)
            self.behind = False
            return [], False
        return self._records(data), restarted

    def _records(self, data: bytes) -> list[dict[str, Any]]:
        out = []
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            last = i == len(lines) - 1  # no newline after it yet
            if self.skipping:
                self.skipping = last
                continue
            line = self.partial + line
            self.partial = b""
            if last:
                if len(line) > MAX_LINE_BYTES:
                    self.damaged += 1
                    self.skipping = True
                else:
                    self.partial = line
                continue
            if not line.strip():
                continue
            rec = _parse_line(line) if len(line) <= MAX_LINE_BYTES else _DAMAGED
            if isinstance(rec, dict):
                out.append(rec)
            else:
                self.damaged += 1
        return out


def read_jsonl(
    target: str, schema: Schema | None = None, within: str | None = None
) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; lines that are not one (cut by a kill mid-write,
    garbage bytes, another type) are skipped: the rest is still good. With ``schema``, only the
    fields that fit it (:func:`read_records` names the others). A file refused as
    :func:`read_checked` refuses one reads as empty."""
    if schema is not None:
        return read_records(target, schema, within)[0]
    f, _ = _open_lines(target, within)
    if f is None:
        return []
    with f:
        return [rec for _, rec in _lines(f) if isinstance(rec, dict)]


def open_jsonl(target: str) -> BinaryIO:
    """Open a JSON-lines file for appending. A line left unfinished by a killed writer is closed
    first, so it cannot swallow the next record."""
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    f = open(target, "a+b")  # noqa: SIM115 - the caller owns it (the writer appends to it)
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


def record_attempt(paths: RunPaths, **fields: object) -> int:
    """Append this job start to attempts.jsonl; returns its attempt number."""
    n = attempt_count(paths)
    append_jsonl(paths.attempts, {"attempt": n, "started_at": time.time(), **fields})
    return n


def record_stop(paths: RunPaths, **fields: object) -> None:
    """A line of stops.jsonl: ``reason`` and what the caller says of the stop, with the attempt
    that stopped (the newest) and when, unless given."""
    append_jsonl(paths.stops, {"attempt": current_attempt(paths), "at": time.time(), **fields})


def count_stops(paths: RunPaths, reason: str) -> int:
    return sum(1 for r in read_jsonl(paths.stops) if r.get("reason") == reason)


# The stops.jsonl reason of a requeue after a node failure; its line names the ``node`` and
# whether Slurm took it as ``excluded``.
NODE_FAILURE = StopReason.NODE_FAILURE


def excluded_nodes(paths: RunPaths) -> list[str]:
    """The nodes this run's jobs left out after a node failure (their stops.jsonl lines)."""
    return sorted(
        {
            str(r["node"])
            for r in read_jsonl(paths.stops)
            if r.get("reason") == NODE_FAILURE and r.get("excluded") and r.get("node")
        }
    )


def write_ledger(paths: RunPaths, record: dict[str, Any]) -> None:
    """RUN_DIR/sample_ledger.json: the sample ledger of the committed checkpoint the run continues
    from (rank 0, after each commit and at each start). A hint: every checkpoint holds its
    ledger, so a file that cannot be written (a folder in its place, no permission, a full disk)
    is a warning, and training goes on."""
    try:
        durable.write_atomic(paths.sample_ledger, json.dumps(record, separators=(",", ":")))
    except (OSError, RunFailed) as exc:
        log.warning(
            "%s cannot be written (%s); training goes on: the sample ledger is kept in each "
            "checkpoint (its manifest's samples), and status shows it once the file can be "
            "written again (move away what is in its place)",
            paths.sample_ledger,
            " ".join(str(exc).split()),
        )


def write_error(paths: RunPaths, rank: int, host: str, error: str, trace: str) -> None:
    record = {"rank": rank, "host": host, "error": error, "traceback": trace, "time": time.time()}
    durable.write_atomic(paths.error_file(rank), json.dumps(record, indent=1))
