"""The states a run can be in, and the reasons a run stops: the one definition that the job,
``submit``, ``status``, ``logs`` and ``cancel`` share.

status.json's ``state`` holds one of these; ``status`` may show another one when what it sees
contradicts the record (``manage/verdict.py`` decides): what is committed wins over any record,
so a run whose final ``model.pt`` sits next to its last step's checkpoint is ``completed``.
Only ``rundir/transitions.py`` writes the state, by the transitions its table allows.
docs/status.md repeats this table (tests/test_status_records.py checks that they agree).

| state       | meaning                                                                          |
|-------------|----------------------------------------------------------------------------------|
| pending     | submitted, no attempt has started                                                |
| running     | an attempt is training (or was, until something shows it is gone)                |
| requeued    | stopped on a signal; Slurm brings the job back by itself                         |
| stopped     | stopped and nothing brings it back: submitting the same config resumes it        |
| completed   | trained to the end; ``model.pt`` holds the final weights                         |
| failed      | ended by an error                                                                |
| cancelled   | a user cancelled it (``clusterflow cancel``); it never comes back by itself      |
"""

from __future__ import annotations

from enum import Enum


class Name(str, Enum):
    """A name written into the run's records: equal to, hashed, printed, formatted and shown
    (``repr``) as its string value, so JSON, logs, comparisons with what a record holds and a
    failed assertion's diff see the plain string."""

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class State(Name):
    PENDING = "pending"
    RUNNING = "running"
    REQUEUED = "requeued"
    STOPPED = "stopped"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StopReason(Name):
    """Why an attempt stopped before the end: the trainer's agreed reason (a signal or the user's
    cancel), the ``reason`` of a stops.jsonl line."""

    PREEMPTED = "preempted"  # SIGTERM: preemption, scontrol requeue, scancel
    TIMEOUT = "timeout"  # the time-limit signal (SIGUSR1/SIGUSR2)
    INTERRUPTED = "interrupted"  # SIGINT (Ctrl-C)
    CANCELLED = "cancelled"  # the user's cancel marker (clusterflow cancel)
    NODE_FAILURE = "node_failure"  # a node's fault; the job requeued without that node


class StopHow(Name):
    """How a time-limit stop came about: the ``how`` of its stops.jsonl line."""

    SIGNAL = "signal"  # Slurm's --signal (SIGUSR2) ahead of the time limit, or SIGUSR1
    END = "end"  # the job's own watch of its end: closer than two saves and the margin


class Cause(Name):
    """The ``kind`` of an attempt's first cause (errors/first.attempt<A>.json)."""

    ERROR = "error"  # an exception on a rank
    STALL = "stall"  # the stall watchdog ended a rank that made no progress


PENDING = State.PENDING
RUNNING = State.RUNNING
REQUEUED = State.REQUEUED
STOPPED = State.STOPPED
COMPLETED = State.COMPLETED
FAILED = State.FAILED
CANCELLED = State.CANCELLED

STATES = tuple(State)

# Nothing of the run is running, and nothing brings it back by itself.
ENDED = frozenset({COMPLETED, FAILED, STOPPED, CANCELLED})


def ended(state: str | None) -> bool:
    """True when a run in ``state`` runs nowhere and will not come back by itself."""
    return state in ENDED


def parse(value: object) -> State | None:
    """The state a record holds, or None when it holds none (or something that is no state)."""
    try:
        return State(value)
    except ValueError:
        return None
