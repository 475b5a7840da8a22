"""The one rule for what `status` shows as state and error (manage/verdict.py), as a table."""

import pytest

from clusterflow.manage.verdict import Evidence, decide, needs_liveness

RANK1 = {"rank": 1, "host": "node2", "error": "RuntimeError: boom", "kind": "error"}
STALL = {
    "rank": 1,
    "host": "node2",
    "kind": "stall",
    "step": 20,
    "phase": "train",
    "stalled_s": 60,
    "where": "x.py:3 f",
    "error": "rank 1 on node2 stalled 60 s at step 20 in train (x.py:3 f)",
}
GONE = "no live process since 10:00:00 (its 2 process(es) on vm are gone); last step 7"
SRUN = (1, "node2", "Killed")

# (evidence, state, error): the first row that applies in docs/status.md's table wins.
TABLE = [
    # what is committed (model.pt and the last step's checkpoint) says completed, whatever the
    # records say: lost, behind, or contradicted by the queue, the processes or a cancel
    (Evidence(completed=True), "completed", None),
    (Evidence(recorded_state="running", attempts=1, completed=True), "completed", None),
    (
        Evidence(recorded_state=None, attempts=1, alive=False, liveness=GONE, completed=True),
        "completed",
        None,
    ),
    (Evidence(recorded_state="failed", queue="", completed=True), "completed", None),
    (Evidence(recorded_state="running", cancelled=True, completed=True), "completed", None),
    # nothing recorded yet
    (Evidence(), "pending", None),
    (Evidence(attempts=1), "running", None),
    (Evidence(started=True), "running", None),
    # status.json's own word, when nothing contradicts it
    (Evidence(recorded_state="completed"), "completed", None),
    (
        Evidence(recorded_state="stopped", recorded_error="time limit reached 6 times"),
        "stopped",
        "time limit reached 6 times",
    ),
    (Evidence(recorded_state="requeued", attempts=2), "requeued", None),
    # squeue corrects it
    (Evidence(recorded_state="running", attempts=1, queue="PENDING|BeginTime"), "requeued", None),
    (Evidence(recorded_state="pending", queue="PENDING|Priority"), "pending", None),
    (Evidence(recorded_state="pending", queue="RUNNING|None"), "running", None),
    (Evidence(recorded_state="requeued", attempts=1, queue="COMPLETING|None"), "running", None),
    (Evidence(recorded_state="running", attempts=1, queue=""), "failed", None),
    (Evidence(recorded_state="completed", attempts=1, queue=""), "completed", None),
    (Evidence(recorded_state="stopped", attempts=1, queue=""), "stopped", None),
    # no live process behind a claimed "running"
    (Evidence(recorded_state="running", attempts=1, alive=False, liveness=GONE), "failed", GONE),
    (Evidence(recorded_state=None, attempts=1, alive=False, liveness=GONE), "failed", GONE),
    (Evidence(recorded_state="running", attempts=1, alive=True), "running", None),
    (Evidence(recorded_state="running", attempts=1, alive=None), "running", None),
    # the queue's word comes before a process check (which is not asked then)
    (
        Evidence(
            recorded_state="running",
            attempts=1,
            queue="PENDING|BeginTime",
            alive=False,
            liveness=GONE,
        ),
        "requeued",
        None,
    ),
    # a recorded end is not second-guessed by liveness
    (
        Evidence(recorded_state="failed", recorded_error="rank 0: x", alive=False, liveness=GONE),
        "failed",
        "rank 0: x",
    ),
    # the cause of a failure: status.json's, else the first-error record, srun's first task in front
    (
        Evidence(recorded_state="failed", recorded_error="rank 0: RuntimeError: connection reset"),
        "failed",
        "rank 0: RuntimeError: connection reset",
    ),
    (Evidence(recorded_state="failed", first_error=RANK1), "failed", "rank 1: RuntimeError: boom"),
    (
        Evidence(recorded_state="failed", recorded_error="rank 0: reset", srun_first=SRUN),
        "failed",
        "rank 1 on node2 ended first (Killed, as srun reports it); then rank 0: reset",
    ),
    (
        Evidence(recorded_state="failed", recorded_error="rank 1: boom", srun_first=SRUN),
        "failed",
        "rank 1: boom",
    ),
    (
        Evidence(recorded_state="running", attempts=1, queue="", srun_first=SRUN),
        "failed",
        "rank 1 on node2 ended first (Killed, as srun reports it)",
    ),
    (Evidence(recorded_state="completed", srun_first=SRUN), "completed", None),
    # a stall names itself, over srun's and the peers' later accounts
    (
        Evidence(
            recorded_state="failed",
            recorded_error="rank 0: reset",
            first_error=STALL,
            srun_first=SRUN,
        ),
        "failed",
        STALL["error"],
    ),
    (Evidence(recorded_state="running", attempts=1, first_error=STALL), "running", STALL["error"]),
    (Evidence(recorded_state="stopped", first_error=STALL), "stopped", None),
    # a user's cancel wins over anything but completed, and over "running" only once no live
    # process trains
    (Evidence(recorded_state="running", attempts=1, alive=True, cancelled=True), "running", None),
    (
        Evidence(
            recorded_state="running", attempts=1, queue="RUNNING|None", alive=True, cancelled=True
        ),
        "running",
        None,
    ),
    (
        Evidence(recorded_state="running", attempts=1, queue="", alive=False, cancelled=True),
        "cancelled",
        None,
    ),
    (Evidence(recorded_state="running", attempts=1, cancelled=True), "cancelled", None),
    (
        Evidence(recorded_state="requeued", queue="PENDING|BeginTime", attempts=1, cancelled=True),
        "cancelled",
        None,
    ),
    (
        Evidence(recorded_state="running", attempts=1, alive=False, liveness=GONE, cancelled=True),
        "cancelled",
        GONE,
    ),
    (Evidence(recorded_state="completed", cancelled=True), "completed", None),
    (
        Evidence(recorded_state="failed", recorded_error="rank 0: x", cancelled=True),
        "cancelled",
        "rank 0: x",
    ),
]


@pytest.mark.parametrize("evidence, state, error", TABLE)
def test_decide(evidence, state, error):
    v = decide(evidence)
    assert (v.state, v.error) == (state, error)


def test_a_stall_carries_its_facts():
    v = decide(Evidence(recorded_state="failed", first_error=STALL))
    assert v.stalled == {
        "rank": 1,
        "host": "node2",
        "step": 20,
        "phase": "train",
        "stalled_s": 60,
        "where": "x.py:3 f",
    }
    assert decide(Evidence(recorded_state="failed", first_error=RANK1)).stalled is None


@pytest.mark.parametrize(
    "evidence, asked",
    [
        (Evidence(recorded_state="running", attempts=1), True),
        (Evidence(recorded_state=None, attempts=1), True),
        (Evidence(recorded_state="pending", queue=""), True),  # left the queue: failed, but check
        (Evidence(recorded_state="pending"), False),  # nothing started: nothing to check
        (Evidence(recorded_state="failed"), False),
        (Evidence(recorded_state="completed"), False),
        (Evidence(recorded_state=None, attempts=1, completed=True), False),
        (Evidence(recorded_state="requeued", attempts=1, queue="PENDING|BeginTime"), False),
    ],
)
def test_liveness_is_asked_only_when_a_claim_needs_it(evidence, asked):
    assert needs_liveness(evidence) is asked


def test_a_cancel_the_live_job_has_not_acted_on_yet_is_a_note_on_running():
    e = Evidence(recorded_state="running", attempts=1, alive=True, cancelled=True)
    assert "cancel requested" in decide(e).note
    assert decide(Evidence(recorded_state="running", attempts=1, alive=True)).note is None
    gone = Evidence(recorded_state="running", attempts=1, alive=False, cancelled=True)
    assert decide(gone).note is None
