"""The run's tries of a step that keeps failing (rundir/tries.py) and the in-flight record it reads
(rundir/inflight.py): progress resets the count, the same step failing with nothing committed
between gives up after cluster.restarts_in_job restarts, naming the step and the samples of the
batch it died on. The restarts on the real Slurm cluster are in tests/test_slurm_restarts.py."""

import json
import os

import pytest

from clusterflow import rundir
from clusterflow.distributed.sampler import GlobalBatchSampler
from clusterflow.rundir import inflight, timeline, tries


@pytest.mark.parametrize(
    "accumulate, world, position", [(1, 1, 0), (1, 2, 48), (2, 2, 0), (3, 2, 36), (2, 4, 48)]
)
def test_a_micro_batch_is_named_before_it_is_fetched_as_the_sampler_yields_it(
    accumulate, world, position
):
    for rank in range(world):
        s = GlobalBatchSampler(
            203, 24 if accumulate != 3 else 36, rank, world, 3, grad_accum=accumulate
        )
        s.set_epoch(2, position)
        yielded = list(s)
        assert [s.slice_at(k) for k in range(len(yielded))] == yielded
        assert s.slice_at(len(yielded)) is None


def test_the_in_flight_record_is_rewritten_in_place_and_read_back(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    rec = inflight.InFlight(paths, 1, attempt=3)
    rec.note(7, 1, 0, list(range(100, 140)))
    rec.committed(6)  # said at once, before the next note (a crash may come first)
    assert inflight.read(paths, 1)["snapshot"] == 6
    assert inflight.read(paths, 1)["indices"] == list(range(100, 140))
    rec.note(8, 1, 1, [5, 9])  # shorter than the record before: its tail is not read
    assert inflight.read(paths, 1) == {
        "attempt": 3, "step": 8, "epoch": 1, "micro": 1, "snapshot": 6, "indices": [5, 9],
    }  # fmt: skip
    rec.note(9, 1, 0, None)  # a stream: no indices
    assert inflight.read(paths, 1)["indices"] == []
    rec.close()
    assert inflight.read_attempt(paths, 3, 2) == {1: inflight.read(paths, 1)}
    assert inflight.read_attempt(paths, 4, 2) == {}  # an earlier attempt's record is not this one's
    with open(paths.inflight_file(0), "wb") as f:
        f.write(b"garbage")
    assert inflight.read(paths, 0) is None
    os.remove(paths.inflight_file(0))
    os.symlink(paths.inflight_file(1), paths.inflight_file(0))
    assert inflight.read(paths, 0) is None  # a link is never followed


def _ranks(step, snapshots, indices=None):
    return {
        r: {"step": step, "epoch": 1, "snapshot": s, "indices": (indices or {}).get(r, [r])}
        for r, s in enumerate(snapshots)
    }


@pytest.mark.parametrize(
    "tl, ranks, world, expected",
    [
        (None, {}, 2, 4),  # no timeline: it trained nothing new (the fault before's 4)
        ({"restored_step": 8}, {}, 2, 8),
        ({"restored_step": 8, "commit": {"step": 12}}, {}, 2, 12),  # a checkpoint it wrote
        ({"restored_step": 8}, _ranks(13, [12, 12]), 2, 12),  # a snapshot every rank committed
        ({"restored_step": 8}, _ranks(13, [12, 10]), 2, 10),  # rank 1's newest is 10
        ({"restored_step": 8}, _ranks(13, [12]), 2, 8),  # rank 1's record is missing
        ({"restored_step": 8}, _ranks(13, [-1, -1]), 2, 8),  # no snapshots
    ],
)
def test_what_was_committed_when_an_attempt_failed(tl, ranks, world, expected):
    assert tries.committed_at(tl, ranks, world, before=4) == expected


def test_the_batch_it_died_on_is_the_failed_ranks_else_every_ranks():
    ranks = {0: {"step": 13, "epoch": 2, "indices": [1, 2]}, 1: {"step": 13, "epoch": 2,
             "indices": [3, 4]}}  # fmt: skip
    assert tries.died_on(ranks, 1) == (13, 2, {"1": [3, 4]})
    assert tries.died_on(ranks, None) == (13, 2, {"0": [1, 2], "1": [3, 4]})
    assert tries.died_on({**ranks, 1: {**ranks[1], "step": 14}}, None) == (14, 2, {"1": [3, 4]})
    assert tries.died_on({}, 1) == (None, None, {})


@pytest.mark.parametrize(
    "previous, committed, expected",
    [
        (None, 0, (1, True)),  # the run's first fault
        ({"committed": 8, "tries": 2}, 12, (1, True)),  # a newer step committed: progress
        ({"committed": 12, "tries": 1}, 12, (2, False)),
        ({"committed": 12, "tries": 2}, 12, (3, False)),
        ({"committed": 12, "tries": 2}, 10, (3, False)),  # restored from older: no progress
    ],
)
def test_tries_count_faults_without_progress(previous, committed, expected):
    assert tries.count(previous, committed) == expected


def _attempt(paths, attempt, restored, step, snapshot=-1, slices=((0, [7, 8]), (1, [9, 10]))):
    """Attempt ``attempt`` resumed from ``restored`` and died in ``step``, its ranks having
    committed their snapshot ``snapshot``."""
    timeline.write(paths, {"attempt": attempt, "restored_step": restored})
    for rank, indices in slices:
        rec = inflight.InFlight(paths, rank, attempt)
        rec.committed(snapshot)
        rec.note(step, 1, 0, indices)
        rec.close()


def test_a_step_that_keeps_failing_gives_up_after_the_limit_naming_its_samples(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    with open(paths.config, "w") as f:
        f.write("run: {dir: .}\n")
    fault = {"world_size": 2, "limit": 2, "job_id": "41",
             "failure": tries.Failure("crash", 1, "node2", "Segmentation fault")}  # fmt: skip
    # attempt 0 trained from scratch and committed snapshot 12, then died in step 13
    _attempt(paths, 0, 0, 13, snapshot=12)
    v = tries.judge(paths, fault="41:0:0", attempt=0, **fault)
    assert (v.tries, v.progress, v.committed, v.step, v.gave_up) == (1, True, 12, 13, False)
    # each restart resumes from 12 and dies in step 13 again: no progress
    _attempt(paths, 1, 12, 13, snapshot=12)
    v = tries.judge(paths, fault="41:0:1", attempt=1, **fault)
    assert (v.tries, v.progress, v.gave_up) == (2, False, False)
    # judged once (the driver, then a rank of the same step): the line is read back
    assert tries.judge(paths, fault="41:0:1", attempt=1, **fault) == v
    _attempt(paths, 2, 12, 13, snapshot=12)
    v = tries.judge(paths, fault="41:1:0", attempt=2, **fault)  # requeued, counted together
    assert (v.tries, v.gave_up, v.step, v.indices) == (3, True, 13, {"1": [9, 10]})
    assert v.said.startswith("no progress at step 13: tried 3 times"), v.said
    assert "rank 1 on node2: Segmentation fault (crash)" in v.said
    assert "epoch 2) held samples rank 1's slice: 9, 10" in v.said
    assert v.said.endswith(f"python -m clusterflow.submit {paths.config}"), v.said
    assert tries.gave_up(paths, 2) == v.said and tries.gave_up(paths, 3) is None
    lines = [json.loads(x) for x in open(paths.tries)]
    assert [x["attempt"] for x in lines] == [0, 1, 2]  # one line per failed step


def test_a_fault_after_progress_is_tried_again_however_many_came_before(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    fault = {"world_size": 2, "limit": 1, "job_id": "7",
             "failure": tries.Failure("crash", 0, "node1", "Killed")}  # fmt: skip
    for attempt in range(6):  # each attempt commits two steps more than it resumed from
        _attempt(paths, attempt, 2 * attempt, 2 * attempt + 3, snapshot=2 * attempt + 2)
        v = tries.judge(paths, fault=f"7:0:{attempt}", attempt=attempt, **fault)
        assert (v.tries, v.progress, v.gave_up) == (1, True, False)
    # restarts_in_job=1: the next fault without progress is the step's second try, and the last
    _attempt(paths, 6, 12, 15, snapshot=12)
    assert tries.judge(paths, fault="7:0:6", attempt=6, **fault).gave_up


def test_a_step_that_dies_before_its_attempt_is_recorded_is_tried_as_any_other(tmp_path):
    """A crash in start-up leaves no attempt, timeline or in-flight record: each failed step is
    still one try (its own fault id), with nothing new committed."""
    paths = rundir.RunPaths(str(tmp_path))
    fault = {"world_size": 2, "limit": 2, "job_id": "9",
             "failure": tries.Failure("crash", None, None, "Killed")}  # fmt: skip
    verdicts = [tries.judge(paths, fault=f"9:0:{n}", attempt=0, **fault) for n in range(3)]
    assert [(v.tries, v.gave_up) for v in verdicts] == [(1, False), (2, False), (3, True)]
    assert verdicts[-1].said.startswith("no progress past step 0: tried 3 times"), verdicts[-1]
    assert "the last time Killed (crash); find the cause in the rank logs" in verdicts[-1].said
