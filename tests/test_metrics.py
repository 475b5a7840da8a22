"""metrics.jsonl read back as TensorBoard shows it: one value per (step, tag), the latest
attempt's."""

import json
import os

from clusterflow import rundir
from clusterflow.observe.metrics import read_metrics


def test_read_metrics_drops_what_a_dead_attempt_logged_past_the_resume(tmp_path):
    rows = [
        {"step": 1, "attempt": 0, "purge_step": 1},
        *({"step": s, "attempt": 0, "train/loss": 10.0 + s} for s in (1, 2, 3, 4, 5)),
        {"step": 4, "attempt": 0, "checkpoint/save_s": 0.5},
        # attempt 1 resumed from the checkpoint at step 4: it logs again from step 5
        {"step": 5, "attempt": 1, "purge_step": 5},
        *({"step": s, "attempt": 1, "train/loss": 20.0 + s} for s in (5, 6)),
        # attempt 2 resumed from a stop checkpoint at step 6, taken before the end-of-epoch work,
        # which it redoes
        {"step": 6, "attempt": 2, "purge_step": 6},
        {"step": 6, "attempt": 2, "eval/acc": 0.9},
    ]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    got = read_metrics(str(tmp_path))
    assert got == {
        1: {"train/loss": 11.0},
        2: {"train/loss": 12.0},
        3: {"train/loss": 13.0},
        4: {"train/loss": 14.0, "checkpoint/save_s": 0.5},
        5: {"train/loss": 25.0},
        6: {"eval/acc": 0.9},
    }


def test_a_line_cut_by_a_kill_does_not_swallow_the_next_attempts_first_row(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))
    with open(paths.metrics, "w") as f:
        f.write(
            json.dumps({"step": 1, "attempt": 0, "train/loss": 1.0})
            + "\n"
            + '{"step": 2, "attempt": 0, "train/lo'
        )
    with rundir.open_jsonl(paths.metrics) as f:
        f.write((json.dumps({"step": 1, "attempt": 1, "purge_step": 1}) + "\n").encode())
        f.write((json.dumps({"step": 1, "attempt": 1, "train/loss": 2.0}) + "\n").encode())
    assert read_metrics(str(tmp_path)) == {1: {"train/loss": 2.0}}
    assert os.path.getsize(paths.metrics) > 0


def test_each_row_says_when_it_was_logged_and_the_time_is_no_scalar(tmp_path):
    import time

    from clusterflow.observe import scalar_log
    from clusterflow.observe.metrics import TensorBoardWriter

    paths = rundir.RunPaths(str(tmp_path))
    before = time.time()
    w = TensorBoardWriter(paths, attempt=0, purge_step=0)
    w.scalars({"train/loss": 0.5}, 1)
    w.scalars({"train/loss": 0.25}, 2)
    w.close()
    rows = [json.loads(line) for line in open(paths.metrics)]
    assert all(before - 1 <= r["time"] <= time.time() + 1 for r in rows if "train/loss" in r)
    assert read_metrics(str(tmp_path)) == {1: {"train/loss": 0.5}, 2: {"train/loss": 0.25}}
    table, times = {}, {}
    for r in rows:
        scalar_log.fold(table, r, times)
    assert sorted(times) == [1, 2] and times[1] <= times[2]
    scalar_log.fold(table, {"step": 2, "attempt": 1, "purge_step": 2}, times)
    assert sorted(times) == [1] and sorted(table) == [1]  # a purge drops both
