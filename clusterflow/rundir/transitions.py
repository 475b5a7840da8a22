"""Who writes the run's state: the one writer of status.json, and the transitions it allows.

Every change of status.json's ``state`` is one of the named transitions below (``mark_*``),
checked against :data:`ALLOWED` under the file's lock, so the check and the write see the same
record. The fields that are no state (progress, eval, mining, a checkpoint's error) go through
:func:`report`, which never touches the state.

Several writers race on one run: rank 0's loop, a peer that failed or found a faulty node, the
``--local`` watcher, a job that starts after the user's cancel. A transition the table refuses is
such a late writer (a rank's ``running`` after the user's cancel ended the job, a stop after the
run completed): the record is kept, nothing of that write lands, and the process logs one line
(once per run dir and transition). Asking for something that is no transition (a ``state`` in
:func:`report`, an ending that is no state to end in) is a bug: ``ValueError``.

A recorded ``cancelled`` stands while its marker (``cancelled.json``) does; once a resubmission
removed the marker, the run is resumable as a stopped one. docs/status.md repeats the table
(tests/test_transitions.py checks that they agree).

| from \\ to  | submit | start | run | requeue | stop | complete | fail | cancel |
|-------------|--------|-------|-----|---------|------|----------|------|--------|
| (none)      | yes    | yes   | yes | yes     | yes  | yes      | yes  | yes    |
| pending     | yes    | yes   | yes | yes     | yes  | yes      | yes  | yes    |
| running     | yes    | yes   | yes | yes     | yes  | yes      | yes  | yes    |
| requeued    | yes    | yes   | no  | yes     | yes  | yes      | yes  | yes    |
| stopped     | yes    | yes   | no  | yes     | yes  | yes      | yes  | yes    |
| failed      | yes    | yes   | no  | yes     | yes  | yes      | yes  | yes    |
| completed   | yes    | yes   | no  | no      | no   | yes      | no   | no     |
| cancelled   | yes    | no    | no  | no      | no   | yes      | no   | yes    |
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from clusterflow.rundir import cancel_marker
from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.records import read_object
from clusterflow.rundir.states import Name, State, parse
from clusterflow.storage import durable

log = logging.getLogger("clusterflow")


class Move(Name):
    """A transition of the run's state."""

    SUBMIT = "submit"  # submit or a sweep queued a job for the run: pending
    START = "start"  # an attempt begins (rank 0, after taking the run dir): running
    RUN = "run"  # the attempt goes on (the loop's progress): running
    REQUEUE = "requeue"  # saved; Slurm brings the job back: requeued
    STOP = "stop"  # saved; nothing brings it back: stopped
    COMPLETE = "complete"  # trained to the end: completed
    FAIL = "fail"  # ended by an error: failed
    CANCEL = "cancel"  # ended by the user's cancel: cancelled


TARGET = {
    Move.SUBMIT: State.PENDING,
    Move.START: State.RUNNING,
    Move.RUN: State.RUNNING,
    Move.REQUEUE: State.REQUEUED,
    Move.STOP: State.STOPPED,
    Move.COMPLETE: State.COMPLETED,
    Move.FAIL: State.FAILED,
    Move.CANCEL: State.CANCELLED,
}

_EVERY = frozenset(Move)
# The attempt that recorded this ended; its loop's late progress must not revive it.
_ENDED_ATTEMPT = _EVERY - {Move.RUN}

# From-state (None: no record, or one without a valid state) -> the transitions it allows.
ALLOWED: dict[State | None, frozenset[Move]] = {
    None: _EVERY,
    State.PENDING: _EVERY,
    State.RUNNING: _EVERY,
    State.REQUEUED: _ENDED_ATTEMPT,
    State.STOPPED: _ENDED_ATTEMPT,
    State.FAILED: _ENDED_ATTEMPT,
    # A new submission or attempt may begin again (it trains nothing and completes again);
    # what is committed wins over any late stop, failure or cancel.
    State.COMPLETED: frozenset({Move.SUBMIT, Move.START, Move.COMPLETE}),
    # The user's cancel stands until a resubmission; a job that finished training before it saw
    # the cancel completed all the same.
    State.CANCELLED: frozenset({Move.SUBMIT, Move.CANCEL, Move.COMPLETE}),
}

# The endings of an attempt, by the state the job decided on (requeue.after_stop).
_ENDINGS = {
    State.REQUEUED: Move.REQUEUE,
    State.STOPPED: Move.STOP,
    State.COMPLETED: Move.COMPLETE,
    State.FAILED: Move.FAIL,
    State.CANCELLED: Move.CANCEL,
}


def allowed(current: State | None, move: Move) -> bool:
    """Whether a run recorded in ``current`` may take ``move``."""
    return move in ALLOWED[current]


# -- the transitions ----------------------------------------------------------------------------


def mark_submitted(paths: RunPaths, job_id: str | None = None) -> bool:
    """A job was submitted for the run (Slurm, or a sweep's array task): pending."""
    return _move(paths, Move.SUBMIT, job_id=job_id)


def mark_started(
    paths: RunPaths, job_id: str, world_size: int, hosts: list[str], attempt: int
) -> bool:
    """Rank 0 began an attempt: running, with who runs it; an earlier attempt's error is
    cleared."""
    return _move(
        paths,
        Move.START,
        job_id=job_id,
        world_size=world_size,
        hosts=hosts,
        attempt=attempt,
        error=None,
    )


def mark_running(paths: RunPaths, fsync: bool = True, **progress: object) -> bool:
    """The attempt goes on: running, with its progress (step, loss, rate, phase)."""
    return _move(paths, Move.RUN, fsync=fsync, **progress)


def mark_requeued(paths: RunPaths, error: str | None = None) -> bool:
    """Saved (or a node's fault) and Slurm brings the job back."""
    return _move(paths, Move.REQUEUE, **_given(error=error))


def mark_stopped(paths: RunPaths, error: str | None = None) -> bool:
    """Saved and stopped; nothing brings it back (submitting the same config resumes it)."""
    return _move(paths, Move.STOP, **_given(error=error))


def mark_completed(paths: RunPaths) -> bool:
    return _move(paths, Move.COMPLETE)


def mark_failed(paths: RunPaths, error: str | None = None, exit_code: int | None = None) -> bool:
    """Ended by an error; ``error`` and ``exit_code`` when this writer knows the cause."""
    return _move(paths, Move.FAIL, **_given(error=error, exit_code=exit_code))


def mark_cancelled(paths: RunPaths, job_id: str | None = None) -> bool:
    """The job ended on the user's cancel."""
    return _move(paths, Move.CANCEL, **_given(job_id=job_id))


def mark_ended(paths: RunPaths, state: str, error: str | None = None) -> bool:
    """The attempt ended in ``state`` (requeued, stopped, completed, failed or cancelled)."""
    move = _ENDINGS.get(parse(state))  # type: ignore[arg-type]
    if move is None:
        raise ValueError(f"{state!r} is not a state an attempt ends in: {', '.join(_ENDINGS)}")
    return _move(paths, move, **_given(error=error))


def report(paths: RunPaths, fsync: bool = True, **fields: object) -> None:
    """Update fields of status.json that are no state (eval, mining, checkpoint_error,
    progress). ``fsync=False`` for the training loop's progress, where an fsync would cost
    milliseconds at log steps."""
    if "state" in fields:
        raise ValueError("the run's state changes only by a transition (transitions.mark_*)")
    _write(paths, None, fsync, fields)


def current(paths: RunPaths) -> State | None:
    """The state transitions start from: the recorded one, except that a recorded cancel whose
    marker a resubmission removed counts as stopped (resumable)."""
    return _standing(paths, read_object(paths.status)[0])


def _standing(paths: RunPaths, record: dict[str, Any]) -> State | None:
    state = parse(record.get("state"))
    if state is State.CANCELLED and not cancel_marker.is_cancelled(paths):
        return State.STOPPED
    return state


# -- the writer ---------------------------------------------------------------------------------

# The loop and the checkpoint writer's thread both update status.json.
_STATUS_LOCK = threading.Lock()
# (run dir, from, move) refusals already logged by this process: the loop's progress would
# repeat one every second.
_LOGGED: set[tuple[str, Any, Move]] = set()


def _given(**fields: object) -> dict[str, object]:
    return {k: v for k, v in fields.items() if v is not None}


def _move(paths: RunPaths, move: Move, fsync: bool = True, **fields: object) -> bool:
    """Take ``move`` with ``fields``: True when written, False when the table refused it."""
    return _write(paths, move, fsync, fields)


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


def _write(paths: RunPaths, move: Move | None, fsync: bool, fields: dict[str, object]) -> bool:
    """Update status.json with ``fields`` (and ``move``'s state, when the table allows it from
    the recorded one). A power loss right after an unsynced write loses that line, and on a
    filesystem that may commit a rename before the data (not ext4's default) it can leave
    status.json empty: ``status`` then reports it as a damaged record and the next write
    replaces it; the checkpoints, the truth, are untouched."""
    with _STATUS_LOCK, _locked(paths.status):
        record, _ = read_object(paths.status)  # a damaged one is replaced, never a reason to stop
        if move is not None:
            was = _standing(paths, record)
            if not allowed(was, move):
                _log_refusal(paths, was, move)
                return False
            fields = {**fields, "state": TARGET[move]}
        record.update(fields, updated_at=time.time())
        durable.write_atomic(
            paths.status, json.dumps(record, indent=1, sort_keys=True), fsync=fsync
        )
        return True


def _log_refusal(paths: RunPaths, was: State | None, move: Move) -> None:
    key = (paths.root, was, move)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    log.warning(
        "status.json of %s stays %s: %s (%s) is not allowed after %s (a late writer; "
        "rundir/transitions.py)",
        paths.root,
        was,
        TARGET[move],
        move,
        was,
    )
