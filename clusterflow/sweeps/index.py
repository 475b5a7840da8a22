"""The sweep index, ``RUN_DIR/sweep.json``, and what a resubmission of a sweep does.

    {"version": 1,
     "keys": ["train.lr", "mining.k"],      swept keys, in the first submission's --sweep order
     "base": {...},                         the resolved config without the swept keys
     "members": [{"name": "k=10,lr=0.001-3f9a1c", "values": {...}, "overrides": [...]}, ...],
     "submissions": [{"array_job_id": "123", "submitted_at": 1.7e9,
                      "jobs": {"k=10,lr=0.001-3f9a1c": "123_0", ...}}]}   array order

A member's run dir is ``SWEEP_DIR/<name>`` (stored relative, so the sweep dir can be moved). The
file is rewritten atomically, under :func:`locked` so that two submissions of one sweep at once
cannot both submit a member. Resubmitting the same sweep (same keys, same base config except
resources) skips completed members and resumes the others; more values for the same keys add
members; another sweep into the same directory is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from clusterflow import rundir
from clusterflow.config import fingerprint
from clusterflow.errors import UserError
from clusterflow.rundir import states as run_states
from clusterflow.storage import confined, durable
from clusterflow.sweeps.sweep import Member, Sweep

VERSION = 1
# An index holds about 300 bytes per member: 16 MiB is tens of thousands of members. A larger
# file is no index of ours, and is refused by its size before it is read.
MAX_INDEX_BYTES = 16 * 2**20


def is_sweep_dir(paths: rundir.RunPaths) -> bool:
    return os.path.isfile(paths.sweep_index)


def read_index(paths: rundir.RunPaths) -> dict[str, Any] | None:
    """The index, or None for a directory that holds no sweep yet. Refuses a single run's dir."""
    target = paths.sweep_index
    if not os.path.lexists(target):
        if os.path.exists(paths.config):
            raise UserError(
                f"run.dir {paths.root!r} holds a single run (config.yaml), not a sweep; "
                f"choose another run.dir for the sweep"
            )
        return None
    # Not rundir.read_json: a damaged index is refused with its reason, never taken for no index.
    try:
        index = json.loads(confined.read_bytes(target, limit=MAX_INDEX_BYTES).decode("utf-8"))
    except confined.Refused as exc:
        raise UserError(
            f"{target} {exc.why}; a sweep index is a file of the sweep dir that clusterflow "
            "writes: restore it or choose another run.dir"
        ) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(
            f"{target} cannot be read ({exc}); restore it or choose another run.dir"
        ) from None
    if (
        not isinstance(index, dict)
        or index.get("version") != VERSION
        or not isinstance(index.get("members"), list)
    ):
        raise UserError(
            f"{target} is not a clusterflow sweep index "
            f"of version {VERSION}; choose another run.dir"
        )
    wrong = _misshapen(index)
    if wrong:
        raise UserError(
            f"{target} is damaged: {wrong}; restore it (clusterflow writes each member as "
            '{"name": ..., "values": {...}}) or choose another run.dir'
        )
    return index


def _misshapen(index: dict[str, Any]) -> str:
    """What in ``index`` is not as :func:`write_index` writes it ("" when all is): every reader
    of a member takes its name (a folder of the sweep: one path component) and its values."""
    keys = index.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return f"its keys are {_brief(keys)}, not a list of names"
    for m in index["members"]:
        name = m.get("name") if isinstance(m, dict) else None
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\0" in name
            or not isinstance(m.get("values", {}), dict)
        ):
            return f"a member is {_brief(m)}, not a name inside the sweep dir and its values"
    subs = index.get("submissions", [])
    if not isinstance(subs, list) or not all(
        isinstance(s, dict) and isinstance(s.get("jobs", {}), dict) for s in subs
    ):
        return f"its submissions are {_brief(subs)}, not a list of submissions"
    return ""


def _brief(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def write_index(paths: rundir.RunPaths, index: dict[str, Any]) -> None:
    durable.write_atomic(
        paths.sweep_index, json.dumps(index, indent=1, sort_keys=False, default=str)
    )


@contextlib.contextmanager
def locked(paths: rundir.RunPaths) -> Iterator[None]:
    """Hold ``SWEEP_DIR/.sweep.lock`` (flock): one submission of a sweep at a time."""
    os.makedirs(paths.root, exist_ok=True)
    with open(paths.sweep_lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"another submission of the sweep in {paths.root!r} "
                "is running; wait for it, then try again"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def member_record(m: Member) -> dict[str, Any]:
    return {"name": m.name, "values": m.values, "overrides": list(m.overrides)}


def merge(
    index: dict[str, Any] | None, sweep: Sweep
) -> tuple[dict[str, Any], list[fingerprint.Change]]:
    """The index after this submission's members are added, and the resource changes since the
    last submission. Refuses another sweep (other keys, or other result keys) into the same dir."""
    new = {
        "version": VERSION,
        "keys": list(sweep.keys),
        "base": sweep.base,
        "members": [],
        "submissions": [],
    }
    if index is None:
        new["members"] = [member_record(m) for m in sweep.members]
        return new, []
    where = sweep.paths.sweep_index
    if set(index["keys"]) != set(sweep.keys):
        raise UserError(
            f"{where} holds a sweep over {', '.join(index['keys'])}; "
            f"this one sweeps {', '.join(sweep.keys)}. A sweep dir holds "
            "one sweep: sweep the same keys, or choose another run.dir"
        )
    result, resources = fingerprint.compare(index["base"], sweep.base)
    if result:
        raise UserError(
            f"{where} holds a sweep with another config ({fingerprint.summary(result)}); to "
            "resume it, submit the same config; to start another sweep, choose another run.dir"
        )
    known = {m["name"] for m in index["members"]}
    merged = dict(index, base=sweep.base)
    merged["members"] = list(index["members"]) + [
        member_record(m) for m in sweep.members if m.name not in known
    ]
    return merged, resources


@dataclass
class Plan:
    """What a submission of a sweep does with each requested member (names in sweep order)."""

    order: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    skip: dict[str, str] = field(default_factory=dict)  # name -> why

    @property
    def to_submit(self) -> list[str]:
        """New and resumed members, in sweep order: the job array's task order."""
        return [n for n in self.order if n in self.new or n in self.resume]


def plan(names: list[str], states: dict[str, str | None]) -> Plan:
    """``states[name]``: the member's state from status (None: it has no run yet).

    completed: skipped. pending, running, requeued: skipped (one job per run dir). cancelled:
    skipped, since cancelling is how a user drops a bad member (delete its cancelled.json to
    resume it). Anything else (failed, stopped after its time limit, unknown): resumed.
    """
    out = Plan(order=list(names))
    for name in names:
        state = states.get(name)
        if state is None:
            out.new.append(name)
        elif state == run_states.COMPLETED:
            out.skip[name] = run_states.COMPLETED
        elif state in (run_states.PENDING, run_states.RUNNING, run_states.REQUEUED):
            out.skip[name] = f"still {state}"
        elif state == run_states.CANCELLED:
            out.skip[name] = "cancelled (delete its cancelled.json to resume it)"
        else:
            out.resume.append(name)
    return out


def record_submission(
    index: dict[str, Any], array_job_id: str, jobs: dict[str, str], now: float | None = None
) -> dict[str, Any]:
    """The index with one more submission: ``jobs`` maps member names to the job ids submitit
    returned (``123_0``, ...; a single member is a plain job ``123``), in array order."""
    entry = {
        "array_job_id": str(array_job_id),
        "submitted_at": time.time() if now is None else now,
        "jobs": dict(jobs),
    }
    return dict(index, submissions=[*index.get("submissions", []), entry])


def names(paths: rundir.RunPaths) -> set[str]:
    """The member names the index of the sweep dir ``paths`` holds (none without an index)."""
    index = read_index(paths)
    return {m["name"] for m in index["members"]} if index else set()


def member_dirs(paths: rundir.RunPaths, index: dict[str, Any]) -> dict[str, rundir.RunPaths]:
    """name -> the member's run dir, in sweep order."""
    return {m["name"]: rundir.RunPaths(paths.member(m["name"])) for m in index["members"]}


def member_job_id(index: dict[str, Any], name: str) -> str | None:
    """The job id of the newest submission that included ``name``."""
    for sub in reversed(index.get("submissions", [])):
        if name in sub.get("jobs", {}):
            return str(sub["jobs"][name])
    return None
