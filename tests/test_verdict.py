"""The one rule for what `status` shows as state and error (manage/verdict.py), as a table."""

from dataclasses import replace

import pytest

from clusterflow.manage.verdict import Evidence, decide, needs_liveness, needs_slurm
from clusterflow.slurm.outcome import Verdict

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


# The records say requeued (the ranks took their batch step's end for a preemption, or could not
# ask Slurm); what Slurm's own record says decides.
SLURM_FAILED = Verdict(
    "FAILED", "scontrol", exit_code=137, signal=0, nodes="node[1,3]", note="sacct unavailable"
)
COMPLETING = replace(SLURM_FAILED, state="COMPLETING")
RESUME = "resume from its newest checkpoint with: python -m clusterflow.submit r/config.yaml"
REQUEUED = {"recorded_state": "requeued", "attempts": 2, "job_id": "7", "resume": RESUME}


def ended(slurm):
    return (
        f"Slurm ended job 7 without requeueing it ({slurm.line()}), although the run recorded it "
        f"requeued; {RESUME}"
    )


def seen(queue, slurm=None, **more):
    return Evidence(**REQUEUED, queue=queue, slurm=slurm, slurm_runs=1, **more)


SLURM_TABLE = [
    # gone from the queue, Slurm says FAILED and counted no requeue beyond the known run
    (seen("", SLURM_FAILED), True, "failed", ended(SLURM_FAILED)),
    # no attempt ran in that job (a resubmission that failed before it started)
    (Evidence(**REQUEUED, queue="", slurm=SLURM_FAILED), True, "failed", ended(SLURM_FAILED)),
    # completing, no requeue counted: the job is ending for good (its ranks still saving)
    (seen("COMPLETING|None", COMPLETING), True, "failed", ended(COMPLETING)),
    # completing with a requeue counted (scontrol requeue), or pending again: it comes back
    (seen("COMPLETING|None", replace(COMPLETING, attempts=2)), True, "requeued", None),
    (seen("", replace(SLURM_FAILED, state="PENDING")), True, "requeued", None),
    # scancel of a requeued job: cancelled, nothing brings it back
    (
        seen("", Verdict("CANCELLED", "scontrol")),
        True,
        "cancelled",
        ended(Verdict("CANCELLED", "scontrol")),
    ),
    # Slurm forgot the job, which is not queued: it never comes back
    (seen("", Verdict("UNKNOWN", "none")), True, "failed", ended(Verdict("UNKNOWN", "none"))),
    # not asked: pending (it comes back), squeue silent, or the records say something else
    (seen("PENDING|BeginTime"), False, "requeued", None),
    (seen(None), False, "requeued", None),
    (Evidence(**{**REQUEUED, "recorded_state": "stopped"}, queue=""), False, "stopped", None),
    # the user's cancel still wins
    (seen("", SLURM_FAILED, cancelled=True), True, "cancelled", None),
]


@pytest.mark.parametrize("evidence, asked, state, error", SLURM_TABLE)
def test_a_run_recorded_requeued_is_reconciled_with_slurm(evidence, asked, state, error):
    assert needs_slurm(evidence) is asked
    v = decide(evidence)
    assert (v.state, v.error) == (state, error)
