"""The states a run can be in: the one definition that the job, ``submit``, ``status``,
``logs`` and ``cancel`` share.

status.json's ``state`` holds one of these; ``status`` may show another one when what it sees
contradicts the record (``manage/verdict.py`` decides): what is committed wins over any record,
so a run whose final ``model.pt`` sits next to its last step's checkpoint is ``completed``.
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

PENDING = "pending"
RUNNING = "running"
REQUEUED = "requeued"
STOPPED = "stopped"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"

STATES = (PENDING, RUNNING, REQUEUED, STOPPED, COMPLETED, FAILED, CANCELLED)

# Nothing of the run is running, and nothing brings it back by itself.
ENDED = frozenset({COMPLETED, FAILED, STOPPED, CANCELLED})


def ended(state: str | None) -> bool:
    """True when a run in ``state`` runs nowhere and will not come back by itself."""
    return state in ENDED
