"""Per-rank heartbeats: the writer thread, the step time it derives, the reader's marks, real gloo
ranks."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import launch
import pytest
from conftest import REPO

from clusterflow import rundir
from clusterflow.observe.heartbeat import (
    Heartbeat,
    mark,
    read_ranks,
    render,
    summary,
    tensorboard_scalars,
)
from clusterflow.observe.stragglers import scores as straggler_scores

GPU0 = {
    "index": 0,
    "uuid": "GPU-aaaa",
    "name": "NVIDIA H100",
    "memory_total_mb": 81559,
    "memory_used_mb": 30720,
    "util_pct": 97,
    "temp_c": 64,
    "processes": [],
}


def test_beat_is_cheap_and_the_thread_writes_at_most_every_heartbeat_s(tmp_path):
    writes = []

    class Counting(Heartbeat):
        def write(self):
            writes.append(time.monotonic())
            return super().write()

    hb = Counting(rundir.RunPaths(str(tmp_path)), rank=3, host="node2", every_s=0.25)
    t0 = time.monotonic()
    for step in range(1, 20001):
        hb.beat(step, "train")
    time.sleep(0.6)
    elapsed = time.monotonic() - t0
    hb.close()
    assert (
        1 <= len(writes) <= 2 + elapsed / 0.25
    )  # 20,000 beats, a handful of writes (+1 from close)
    rec = json.loads((tmp_path / "heartbeats" / "rank3.json").read_text())
    assert (rec["rank"], rec["host"], rec["step"], rec["phase"], rec["beats"]) == (
        3,
        "node2",
        20000,
        "train",
        20000,
    )
    assert rec["pid"] == os.getpid() and abs(rec["time"] - time.time()) < 60
    assert sorted(os.listdir(tmp_path / "heartbeats")) == [
        "rank3.json"
    ]  # the temp file was renamed away


def test_the_longest_pause_between_writes_stays_on_record(tmp_path, monkeypatch):
    """A rank frozen (SIGSTOP) and woken again (Slurm's SIGCONT before the step's SIGTERM) writes
    fresh heartbeats, but its record keeps the pause: the restart driver reads it."""
    from clusterflow.observe import heartbeat

    clock = iter([100.0, 100.5, 122.0, 122.5])
    monkeypatch.setattr(heartbeat.time, "time", lambda: next(clock))
    hb = Heartbeat(rundir.RunPaths(str(tmp_path)), 1, "n2", 0.5, start=False)
    first = hb.write()
    assert (first["paused_from"], first["paused_to"]) == (None, None)
    hb.write(), hb.write()
    last = hb.write()
    assert (last["time"], last["paused_from"], last["paused_to"]) == (122.5, 100.5, 122.0)
    assert read_ranks(hb.paths, 0.5, now=123.0)[0]["paused_to"] == 122.0  # fits its schema


def test_a_rank_that_has_not_beaten_yet_says_starting(tmp_path):
    rec = Heartbeat(rundir.RunPaths(str(tmp_path)), 0, "n1", 10, start=False).write()
    assert rec["phase"] == "starting" and rec["progress_at"] is None and rec["step_time_s"] is None


def test_step_time_is_wall_time_per_training_step_between_writes(tmp_path):
    hb = Heartbeat(rundir.RunPaths(str(tmp_path)), 0, "n1", 10, start=False)
    hb.beat(10, "train")
    at10 = hb.progress.snapshot()[3]
    assert hb.record()["step_time_s"] is None  # one point is not an interval
    time.sleep(0.05)
    hb.beat(20, "train")
    at20 = hb.progress.snapshot()[3]
    assert hb.record()["step_time_s"] == pytest.approx((at20 - at10) / 10)
    hb.beat(20, "eval")  # eval batches do not advance the step: the training step time stays
    assert hb.record()["step_time_s"] == pytest.approx((at20 - at10) / 10)
    hb.beat(21, "train")  # the first step after eval includes the eval: not a step time
    assert hb.record()["step_time_s"] == pytest.approx((at20 - at10) / 10)
    hb.beat(22, "train", step_time_s=0.125)  # a loop that measures its own step time wins
    assert hb.record()["step_time_s"] == 0.125


def test_gpu_fields_come_from_the_snapshot_of_this_ranks_gpu(tmp_path):
    snap = [GPU0, {**GPU0, "index": 1, "uuid": "GPU-bbbb", "memory_used_mb": 100, "util_pct": 3}]
    by_index = Heartbeat(
        rundir.RunPaths(str(tmp_path)), 0, "n1", 10, gpu=1, start=False, snapshot=lambda: snap
    ).record()
    assert (by_index["gpu_index"], by_index["gpu_mem_used_mb"], by_index["gpu_util_pct"]) == (
        1,
        100,
        3,
    )
    by_uuid = Heartbeat(
        rundir.RunPaths(str(tmp_path)),
        0,
        "n1",
        10,
        gpu="GPU-aaaa",
        start=False,
        snapshot=lambda: snap,
    ).record()
    assert (by_uuid["gpu_index"], by_uuid["gpu_mem_total_mb"], by_uuid["gpu_temp_c"]) == (
        0,
        81559,
        64,
    )
    no_nvml = Heartbeat(
        rundir.RunPaths(str(tmp_path)), 0, "n1", 10, gpu=0, start=False, snapshot=lambda: None
    ).record()
    assert not [k for k in no_nvml if k.startswith("gpu_")]


def test_a_failing_write_does_not_stop_the_thread(tmp_path):
    hb = Heartbeat(rundir.RunPaths(str(tmp_path / "run")), 0, "n1", every_s=0.05)
    os.rename(tmp_path / "run", tmp_path / "moved")  # the run dir vanishes under the writer
    time.sleep(0.2)
    assert hb._thread.is_alive()
    os.makedirs(tmp_path / "run" / "heartbeats")
    hb.beat(7, "train")
    time.sleep(0.3)
    hb.close()
    assert json.loads((tmp_path / "run" / "heartbeats" / "rank0.json").read_text())["step"] == 7


def _rec(rank, age, busy=0.2, phase="train", host=None, now=1000.0, **extra):
    return {
        "rank": rank,
        "host": host or f"node{rank // 4 + 1}",
        "step": 50,
        "phase": phase,
        "time": now - age,
        "progress_at": now - age,
        "step_time_s": busy,
        "busy_s": busy,
        **extra,
    }


@pytest.mark.parametrize(
    "records,heartbeat_s,ratio,silent,stragglers",
    [
        ([_rec(0, 1), _rec(1, 2)], 10, 1.2, [], []),  # all fresh, equal
        ([_rec(0, 1), _rec(1, 31)], 10, 1.2, [1], []),  # 31 s > max(3 x 10, 30)
        ([_rec(0, 1), _rec(1, 29)], 10, 1.2, [], []),  # under the 30 s floor
        ([_rec(0, 1), _rec(1, 100)], 60, 1.2, [], []),  # 100 s < 3 x 60
        ([_rec(0, 1), _rec(1, 1, 0.5)], 10, 1.2, [], [1]),  # two ranks: the other is the median
        # lock-step DDP: every step takes the slowest rank's time; its own part tells
        ([_rec(0, 1, step_time_s=0.5), _rec(1, 1, 0.5)], 10, 1.2, [], [1]),
        ([_rec(0, 1, step_time_s=0.9), _rec(1, 1, step_time_s=0.2)], 10, 1.2, [], []),
        ([_rec(0, 1), _rec(1, 1, 0.29)], 10, 1.5, [], []),  # 1.45 x under observe.straggler_ratio
        ([_rec(0, 1), _rec(1, 1, 0.29)], 10, 1.2, [], [1]),
        ([_rec(0, 1), _rec(1, 1, 0.5)], 10, 0, [], []),  # straggler_ratio 0: the watch is off
        ([_rec(r, 1, 0.2) for r in range(7)] + [_rec(7, 1, 0.35)], 10, 1.2, [], [7]),
        (
            [_rec(r, 1, 0.2) for r in range(4)] + [_rec(4, 1, 0.5, phase="eval")],
            10,
            1.2,
            [],
            [],
        ),  # eval is not compared
        (
            [_rec(0, 1, 0.2), _rec(1, 1, 0.2), _rec(2, 90, 5.0)],
            10,
            1.2,
            [2],
            [],
        ),  # a silent rank is not a straggler
        ([_rec(0, 1, None), _rec(1, 1, 0.9)], 10, 1.2, [], []),  # no busy time yet: no compare
    ],
)
def test_marks(records, heartbeat_s, ratio, silent, stragglers):
    out = mark(records, heartbeat_s, now=1000.0, straggler_ratio=ratio)
    assert [r["rank"] for r in out if r["silent"]] == silent
    assert [r["rank"] for r in out if r["straggler"]] == stragglers
    assert all(
        r["heartbeat_age_s"] == round(1000.0 - rec["time"], 1) for r, rec in zip(out, records)
    )


def test_the_mark_and_the_straggler_watch_score_a_rank_alike():
    """One definition: a rank marked on a read is a rank the watch counts as slow on it."""
    records = [_rec(r, 1, 0.2) for r in range(3)] + [_rec(3, 1, 0.3), _rec(4, 1, 0.23)]
    out = mark(records, 10, now=1000.0, straggler_ratio=1.2)
    scored = straggler_scores(out)
    slow = [rank for rank, (ratio, _) in scored.items() if ratio > 1.2]
    assert [r["rank"] for r in out if r["straggler"]] == slow == [3]
    assert out[3]["busy_ratio"] == round(scored[3][0], 3) and out[3]["median_busy_s"] == 0.2


def _write(run_dir, rec):
    os.makedirs(os.path.join(run_dir, "heartbeats"), exist_ok=True)
    with open(rundir.RunPaths(run_dir).heartbeat_file(rec["rank"]), "w") as f:
        json.dump(rec, f)


def test_read_ranks_drops_earlier_attempts_and_lists_missing_ranks(tmp_path):
    d = str(tmp_path)
    now = 10_000.0
    _write(d, _rec(0, 2, now=now))
    _write(d, _rec(1, 500, now=now))  # left by the previous attempt (before `since`)
    _write(d, _rec(5, 2, now=now))  # a rank of a larger earlier attempt
    with open(os.path.join(d, "heartbeats", "rank2.json"), "w") as f:
        f.write('{"rank": 2, "ho')  # cut short (cannot happen with rename; a hand-copied dir might)
    with open(os.path.join(d, "heartbeats", ".rank3.tmp"), "w") as f:
        f.write("{}")
    out = read_ranks(rundir.RunPaths(d), 10, now=now, since=now - 100, world_size=4)
    assert [r["rank"] for r in out] == [0, 1, 2, 3]
    assert [r["silent"] for r in out] == [False, True, True, True]
    assert out[1]["phase"] is None and out[1]["heartbeat_age_s"] is None
    assert [r["rank"] for r in read_ranks(rundir.RunPaths(d), 10, now=now)] == [
        0,
        1,
        5,
    ]  # without an attempt: all it finds
    assert read_ranks(rundir.RunPaths(str(tmp_path / "nothing")), 10) == []


def test_render_and_summary_name_the_odd_ranks():
    ranks = mark(
        [
            _rec(
                0,
                3,
                0.2,
                gpu_index=0,
                gpu_mem_used_mb=30720,
                gpu_mem_total_mb=81559,
                gpu_util_pct=97,
                gpu_temp_c=64,
            ),
            _rec(1, 4, 0.2),
            _rec(2, 2, 0.61, host="node3"),
            _rec(3, 95, 0.2, host="node4"),
        ],
        10,
        now=1000.0,
        straggler_ratio=1.2,
    )
    table = render(ranks)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["rank", "host", "step", "phase"]
    assert "30.0/80 GiB" in lines[1] and "97%" in lines[1] and "64C" in lines[1]
    assert lines[3].rstrip().endswith("straggler") and lines[4].rstrip().endswith("silent")
    assert summary(ranks) == (
        "rank 2 on node3 straggles (0.610 s of its own work a step, 3.05x the others' median "
        "0.200 s); "
        "rank 3 on node4 is silent (last heartbeat 95 s ago)"
    )
    assert summary(ranks[:2]) is None
    assert (
        summary(mark([{"rank": 5, "time": None}], 10, now=1000.0))
        == "rank 5 has sent no heartbeat in this attempt"
    )


def test_tensorboard_scalars_cover_every_node():
    ranks = mark(
        [
            _rec(0, 1, 0.2, gpu_index=0, gpu_mem_used_mb=2048, gpu_util_pct=90, host="node1"),
            _rec(1, 1, 0.3, gpu_index=0, gpu_mem_used_mb=1024, gpu_util_pct=50, host="node2"),
            _rec(2, 99, 0.3, host="node3"),
        ],
        10,
        now=1000.0,
    )
    assert tensorboard_scalars(ranks) == {
        "ranks/step_time_s/rank0": 0.2,
        "ranks/busy_s/rank0": 0.2,
        "gpus/node1/gpu0/mem_used_gb": 2.0,
        "gpus/node1/gpu0/util_pct": 90.0,
        "ranks/step_time_s/rank1": 0.3,
        "ranks/busy_s/rank1": 0.3,
        "gpus/node2/gpu0/mem_used_gb": 1.0,
        "gpus/node2/gpu0/util_pct": 50.0,
    }


def _two_rank_heartbeats(run_dir):
    import socket

    from clusterflow.distributed import comm as dist

    rank = dist.rank()
    hb = Heartbeat(
        rundir.RunPaths(run_dir), rank, socket.gethostname(), every_s=0.1, gather=rank == 0
    )
    for step in range(1, 31):
        dist.barrier()  # a collective per step, as training has
        hb.beat(step, "train")
        time.sleep(0.01)
    time.sleep(0.5)
    ranks = hb.ranks()
    dist.barrier()
    hb.close()
    return [(r["rank"], r["step"], r["phase"], r["silent"]) for r in ranks]


def test_two_real_ranks_see_each_other_through_their_heartbeats(tmp_path):
    from multirank import run_ranks

    results = run_ranks(2, _two_rank_heartbeats, str(tmp_path))
    assert results[0] == [(0, 30, "train", False), (1, 30, "train", False)]
    assert results[1] == []  # only rank 0 gathers
    out = read_ranks(rundir.RunPaths(str(tmp_path)), 0.1, world_size=2)
    assert [r["step"] for r in out] == [30, 30] and all(r["pid"] for r in out)


def test_cpu_use_memory_and_data_wait_are_each_ranks_own(tmp_path):
    """A real 3-rank local run: rank 1 keeps a core busy on a thread of its own, rank 2 waits
    for a slow dataset, rank 0 does neither. While it trains, their heartbeats and `status
    --ranks` show rank 1's CPU use and rank 2's data wait, and nobody else's. (Ranks by
    tests/launch.py: each rank measures its own process, whatever started it.)"""
    d = str(tmp_path / "run")
    over = [
        f"run.dir={d}",
        "task.target=testtasks:Unequal",
        "task.params.hungry_rank=1",
        "task.params.starved_rank=2",
        "task.params.fetch_sleep=0.02",
        "cluster.tasks_per_node=3",
        "train.batch_size=30",
        "train.epochs=40",
        "mining.enabled=false",
        "train.eval_every_epochs=0",
        "checkpoint.every_steps=1000",
        "dist.heartbeat_s=0.5",
    ]
    env = {"PYTHONPATH": os.path.join(REPO, "tests")}
    procs = launch.start(3, "configs/tiny.yaml", over, str(tmp_path / "logs"), env=env)
    paths = rundir.RunPaths(d)
    try:
        deadline, first = time.monotonic() + 240, None
        while True:
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            ranks = read_ranks(paths, 0.5) if os.path.isdir(paths.heartbeats) else []
            # Two writes in training after step 12: a window of steady steps on every rank.
            if len(ranks) == 3 and all((r.get("step") or 0) >= 12 for r in ranks):
                if first is None:
                    first = {r["rank"]: r["time"] for r in ranks}
                elif all(r["time"] > first[r["rank"]] for r in ranks):
                    break
            else:
                first = None
            assert time.monotonic() < deadline, ranks
            time.sleep(0.2)
        table = subprocess.run(
            [sys.executable, "-m", "clusterflow.status", d, "--ranks"],
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert table.returncode == 0, table.stderr
    finally:
        launch.kill(procs, signal.SIGKILL)
        launch.wait(procs, timeout=120)
    cpu, wait = {}, {}
    for r in ranks:
        assert r["rss_bytes"] > 50 * 2**20, r  # torch alone takes more
        cpu[r["rank"]], wait[r["rank"]] = r["cpu_percent"], r["data_wait_fraction"]
    # Relative, not a share of a core: on a busy machine the hungry thread gets what is left.
    assert cpu[1] > 2 * max(cpu[0], cpu[2]), cpu
    assert wait[2] > 0.4 and wait[2] > 3 * max(wait[0], wait[1]), wait
    rows = {}
    for line in table.stdout.splitlines()[1:4]:
        m = re.match(r"\s*(\d) .* (\d+)%\s+(\d+) MiB\s+(\d+)%\s", line)
        assert m, table.stdout
        rows[int(m[1])] = (int(m[2]), int(m[4]))
    assert rows[1][0] > 2 * max(rows[0][0], rows[2][0]), table.stdout
    assert rows[2][1] > 3 * max(rows[0][1], rows[1][1], 1), table.stdout
