"""Who writes the run's state (clusterflow/rundir/transitions.py): the table of allowed transitions,
pair by pair, on real status.json files; a rank's late ``running`` after the user's cancel, through
the job's own code; and that nothing else in the package writes the state."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, run_cli, write_status_record

from clusterflow import rundir
from clusterflow.rundir import cancel_marker, states, transitions
from clusterflow.rundir.states import Cause, State, StopReason
from clusterflow.rundir.transitions import Move

# What each transition may follow, written out (from-state -> the moves it allows); the order of
# the columns: submit start run requeue stop complete fail cancel. "(none)": no record.
EXPECTED = """
(none)     Y Y Y Y Y Y Y Y
pending    Y Y Y Y Y Y Y Y
running    Y Y Y Y Y Y Y Y
requeued   Y Y . Y Y Y Y Y
stopped    Y Y . Y Y Y Y Y
failed     Y Y . Y Y Y Y Y
completed  Y Y . . . Y . .
cancelled  Y . . . . Y . Y
"""
COLUMNS = [Move.SUBMIT, Move.START, Move.RUN, Move.REQUEUE]
COLUMNS += [Move.STOP, Move.COMPLETE, Move.FAIL, Move.CANCEL]


def _expected():
    out = {}
    for line in EXPECTED.strip().splitlines():
        name, *cells = line.split()
        state = None if name == "(none)" else State(name)
        for move, cell in zip(COLUMNS, cells, strict=True):
            out[(state, move)] = cell == "Y"
    return out


PAIRS = sorted(_expected().items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))


def test_the_table_covers_every_state_and_move():
    assert set(transitions.ALLOWED) == {None, *State}
    assert {pair for pair, _ in PAIRS} == {(s, m) for s in [None, *State] for m in Move}


@pytest.mark.parametrize("pair,allowed", PAIRS, ids=[f"{s}-{m}" for (s, m), _ in PAIRS])
def test_each_transition_is_allowed_or_refused_on_a_real_record(tmp_path, pair, allowed):
    was, move = pair
    d = str(tmp_path / "run")
    paths = rundir.RunPaths(d)
    os.makedirs(d)
    if was is not None:
        write_status_record(d, state=was, global_step=7)
    if was is State.CANCELLED:
        cancel_marker.mark(rundir.RunPaths(d), "11")
    assert transitions.allowed(was, move) is allowed
    written = {
        Move.SUBMIT: lambda: transitions.mark_submitted(paths, job_id="12"),
        Move.START: lambda: transitions.mark_started(paths, "12", 1, ["h"], 0),
        Move.RUN: lambda: transitions.mark_running(paths, global_step=8),
        Move.REQUEUE: lambda: transitions.mark_requeued(paths),
        Move.STOP: lambda: transitions.mark_stopped(paths),
        Move.COMPLETE: lambda: transitions.mark_completed(paths),
        Move.FAIL: lambda: transitions.mark_failed(paths, error="boom", exit_code=1),
        Move.CANCEL: lambda: transitions.mark_cancelled(paths),
    }[move]()
    rec = json.load(open(paths.status)) if os.path.exists(paths.status) else {}
    assert written is allowed
    if allowed:
        assert rec["state"] == transitions.TARGET[move]
    else:  # the record is kept whole: a refused write lands nothing
        assert rec == {"state": was, "global_step": 7}


def test_a_cancel_withdrawn_by_a_resubmission_resumes_like_a_stop(tmp_path):
    """Once submit removed the marker, the recorded cancel no longer binds the next attempt."""
    d = str(tmp_path / "run")
    write_status_record(d, state="cancelled")
    paths = rundir.RunPaths(d)
    assert transitions.current(paths) is State.STOPPED
    assert transitions.mark_started(paths, "5", 1, ["h"], 1)
    assert json.load(open(paths.status))["state"] == "running"


def test_an_ending_that_is_no_state_and_a_state_outside_a_transition_are_bugs(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    with pytest.raises(ValueError, match="not a state an attempt ends in"):
        transitions.mark_ended(paths, "running")
    with pytest.raises(ValueError, match="only by a transition"):
        transitions.report(paths, state="completed")
    transitions.mark_ended(paths, State.STOPPED, error="why")
    assert json.load(open(paths.status))["state"] == "stopped"


def test_states_and_reasons_are_the_strings_the_records_hold():
    assert [str(s) for s in State] == [
        "pending", "running", "requeued", "stopped", "completed", "failed", "cancelled"
    ]  # fmt: skip
    assert [f"{r}" for r in StopReason] == [
        "preempted", "timeout", "interrupted", "cancelled", "node_failure"
    ]  # fmt: skip
    assert [f"{c}" for c in Cause] == ["error", "stall"]
    assert json.dumps({"s": State.RUNNING, "r": StopReason.TIMEOUT}) == (
        '{"s": "running", "r": "timeout"}'
    )
    assert "completed" in states.ENDED and states.parse("garbage") is None


def _table_rows(text):
    rows = {}
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] in {"(none)", *map(str, State)}:
            rows[cells[0]] = cells[1:]
    return rows


def test_the_transition_table_of_the_docs_and_of_transitions_py_is_the_table():
    with open(os.path.join(REPO, "docs", "status.md")) as f:
        docs = _table_rows(f.read())
    code = _table_rows(transitions.__doc__)
    want = {
        str(s) if s else "(none)": ["yes" if m in transitions.ALLOWED[s] else "no" for m in COLUMNS]
        for s in transitions.ALLOWED
    }
    assert docs == code == want, (docs, code)


# -- through the job's own code -----------------------------------------------------------------

LATE_RANK = """
import sys
from clusterflow.distributed.env import DistEnv
from clusterflow import rundir
from clusterflow.job import attempt
from clusterflow.rundir import saved_config
cfg = saved_config.read(sys.argv[1])
attempt._start(DistEnv.from_env({}), cfg, rundir.RunPaths(cfg.run.dir), "cpu")
"""


def test_a_rank_reporting_running_after_the_users_cancel_leaves_it_cancelled(tmp_path):
    """`clusterflow cancel`'s marker, a job that ends on it (state cancelled), then a rank of a
    late attempt reporting that it runs: the cancel stands, and the rank's log says why."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cancel_marker.mark(rundir.RunPaths(run_dir), None)
    r = run_cli("clusterflow.run", "configs/tiny.yaml", "train.epochs=1", f"run.dir={run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr
    status = os.path.join(run_dir, "status.json")
    assert json.load(open(status))["state"] == "cancelled"
    late = subprocess.run(
        [sys.executable, "-c", LATE_RANK, run_dir],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert late.returncode == 0, late.stdout + late.stderr
    assert json.load(open(status))["state"] == "cancelled"
    with open(os.path.join(run_dir, "logs", "rank0.attempt0.log")) as f:
        logged = f.read()
    assert "stays cancelled: running (start) is not allowed after cancelled" in logged


# -- one owner ----------------------------------------------------------------------------------

OWNER = os.path.join("clusterflow", "rundir", "transitions.py")
# A write of status.json's state outside its owner: the old writer, a keyword argument given a
# state, the file itself written, the owner's private writer.
WRITES = [
    re.compile(r"\bwrite_status\b"),
    re.compile(r"\bstate=(states\.|State\.|[\"'](" + "|".join(map(str, State)) + r")[\"'])"),
    re.compile(r"(write_atomic|open)\([^)]*\bstatus\b[^)]*(,\s*[\"']w|\))"),
    re.compile(r"transitions\._"),
]


def test_no_module_but_the_owner_writes_the_state():
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "clusterflow")):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO)
            if not name.endswith(".py") or rel == OWNER:
                continue
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                if any(p.search(line) for p in WRITES) and "read" not in line:
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "status.json written outside rundir/transitions.py:\n" + "\n".join(found)


def test_the_grep_finds_what_it_looks_for():
    """The patterns above match the writes this package used to make."""
    samples = [
        'rundir.write_status(paths, state="cancelled")',
        "rundir.write_status(paths, state=states.CANCELLED, job_id=env.job_id)",
        "self._status(state='running')",
        "durable.write_atomic(paths.status, json.dumps(current))",
        "transitions._write(paths, None, True, {})",
    ]
    assert all(any(p.search(s) for p in WRITES) for s in samples)
