"""Recovery without loss on the real local Slurm cluster (partition wide: node1..3; low: node1..2),
with snapshots in the nodes' memory every 2 steps (checkpoint.memory_every_steps; the nodes share
this machine's /dev/shm, so memory_dir=.../{node} keeps them apart):

- a job of two nodes and a spare, killed three times in one run: node2 lost first (its rank
  SIGKILLed and its memory emptied, the shared filesystem's newest checkpoint truncated), then
  rank 0, then rank 1: every restart is a new srun step in the same Slurm job (no requeue), on
  the nodes left after the failed one (the spare first), records the fault, the nodes left out
  and the time from the fault to the next step, restores from the nodes' memory or a peer's
  replica, never reading the shared filesystem, loses at most 2 steps, and the run ends bitwise
  equal to an uninterrupted one; the goodput ledger books each restart within its allocation;
- a job of two nodes and a spare whose rank 1 is frozen (SIGSTOP) right after a heartbeat: the
  waiting rank's watchdog names it from its quiet heartbeat, the restart leaves node2 out, the
  spare fails its node check (its memory folder is a file) and is left out too, and the job goes
  on alone on node1 (cluster.shrink), every sample once per epoch, as the task recorded it;
  status says it shrank;
- warm restarts (cluster.warm_restarts): a job of two nodes and a spare whose ranks 1, 0, 1, 0
  are killed; each kill waits for the driver's warm standby to be ready, and the third finds one
  of its processes frozen: three restarts hand the ranks to the standby's processes, the third
  falls back to new processes, naming why; then the time limit's signal reaches the ranks of a
  warm step and the idle standby alike, the job requeues itself and completes bitwise equal to
  an uninterrupted run, leaving no standby process behind. The crash-to-next-step seconds of
  both kinds of restart are printed.

The first test runs with warm restarts off: it is the cold restart's figure."""

import json
import os
import re
import shutil
import signal
import statistics
import time
import uuid

import pytest
from conftest import run_cli
from slurmjobs import (
    env,
    live_status,
    read_jsonl,
    scmd,
    sha256,
    status,
    submit,
    wait_gone,
    wait_until,
)

from clusterflow import rundir
from clusterflow.distributed.sampler import EpochPlan
from clusterflow.rundir import RunPaths, first_error, restarts
from clusterflow.storage import snapshots

pytestmark = pytest.mark.slurm


@pytest.fixture
def memory():
    """A memory dir of this test's own under /dev/shm, removed after."""
    path = f"/dev/shm/clusterflow-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _folder(memory, d, node):
    """The run ``d``'s folder in ``node``'s memory."""
    key = snapshots.folder_key(RunPaths(d).memory_key)
    return snapshots.run_folder(f"{memory}/{{node}}", d, node, key)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_three_crashes_restart_in_the_job_on_the_spare_from_memory_and_replicas_bitwise(
    cluster, reference_run, memory, tmp_path
):
    d = str(tmp_path / "run")
    job, out = submit(
        d,
        "cluster.partition=wide",
        "cluster.spare_nodes=1",
        "cluster.restarts_in_job=4",
        "cluster.warm_restarts=false",
        "checkpoint.async=false",
        "checkpoint.memory_every_steps=2",
        f"checkpoint.memory_dir={memory}/{{node}}",
        "task.target=testtasks:SeenSlow",
        f"task.params.run_dir={d}",
        "task.params.step_sleep=0.3",
        # attempt 0: rank 1 before step 9 (steps 1-8 done); attempt 1 (from step 8): rank 0
        # before step 12; attempt 2 (from step 10): rank 1 before step 16
        "task.params.kill=0@9/1,1@4/0,2@6/1",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until("the job running", lambda: os.path.exists(os.path.join(d, "attempts.jsonl")))
    (first,) = read_jsonl(os.path.join(d, "attempts.jsonl"))
    host, pid, _ = first["procs"][1]
    assert host == "node2"
    # node2 is lost: its rank killed itself, and its memory goes with it. The shared
    # filesystem's newest checkpoint is damaged too: a restore that read it would say so.
    alive = [time.time()]  # a moment before rank 1 was last seen alive: before its kill

    def killed():
        now = time.time()
        if _gone(pid):
            return True
        alive[0] = now
        return False

    wait_until("rank 1's kill", killed, timeout=300, job_id=job)
    shutil.rmtree(_folder(memory, d, "node2"))
    with open(os.path.join(d, "checkpoints", "step-8", "model.pt"), "r+b") as f:
        f.truncate(64)
    wait_gone(job, timeout=600)

    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 4, s
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [a["job_id"] for a in attempts] == [job] * 4, attempts  # no requeue, no new job
    assert [a.get("restart_in_job") for a in attempts] == [0, 1, 2, 3], attempts
    assert [sorted(set(a["hosts"])) for a in attempts] == [
        ["node1", "node2"],
        ["node1", "node3"],  # on the spare
        ["node2", "node3"],
        ["node1", "node2"],
    ], attempts
    rs = restarts.read(rundir.RunPaths(d))
    assert [(r["cause"], r["left_out"]) for r in rs] == [
        ("crash", ["node2"]),
        ("crash", ["node1"]),
        ("crash", ["node3"]),
    ], rs
    assert [(r["failed_attempt"], r["next_attempt"]) for r in rs] == [(0, 1), (1, 2), (2, 3)], rs
    # Each fault was seen after its kill (the first after rank 1 was last seen alive, the others
    # after the attempt they ended trained its first step), and training resumed after the
    # restart.
    seen_after = [alive[0]] + [r["first_step_at"] for r in rs[:-1]]
    for r, after in zip(rs, seen_after, strict=True):
        assert after < r["fault_at"] <= r["restart_at"] < r["first_step_at"], (after, r)
    assert s["restored_from"] == [None, "replica", "replica", "replica"], s["restored_from"]
    got = [
        (r["rank"], r["host"], r["nodes"], r["restored_step"], r["first_step"])
        for r in s["restarts"]
    ]
    assert got == [
        (1, "node2", ["node1", "node3"], 8, 9),
        (0, "node1", ["node2", "node3"], 10, 11),
        (1, "node3", ["node1", "node2"], 14, 15),
    ], got
    assert [r["restored_where"] for r in s["restarts"]] == [
        "memory of node1 (rank 0) and replica on node1 (rank 1)",
        "replica on node3 (rank 0) and memory of node3 (rank 1)",
        "memory of node2 (rank 0) and replica on node2 (rank 1)",
    ]
    logs = "".join(
        open(os.path.join(d, "logs", f"rank0.attempt{a}.log")).read() for a in range(1, 4)
    )
    assert "skipping damaged checkpoint" not in logs  # the truncated step-8 was never read
    # Steps lost per crash, as the task recorded its loss calls (the last one of each killed
    # attempt was not trained): the failed attempts trained up to 8, 11 and 15.
    calls = {}
    for name in os.listdir(os.path.join(d, "seen")):
        for r in read_jsonl(os.path.join(d, "seen", name)):
            calls[r["attempt"]] = max(calls.get(r["attempt"], 0), r["call"])
    restored = [0] + [r["restored_step"] for r in s["restarts"]]
    trained = [restored[a] + calls[a] - 1 for a in range(3)]
    lost = [trained[a] - restored[a + 1] for a in range(3)]
    assert lost == [0, 1, 1] and max(lost) <= 2, (trained, restored)
    # The goodput ledger's count comes from the timeline, written at most once a second: it may
    # be short, never over.
    out = run_cli("clusterflow.goodput", d, "--json", env=env())
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)["attempts"]
    said = [r["restart_in_job"]["steps_lost"] for r in rows[1:]]
    assert all(0 <= x <= y for x, y in zip(said, lost, strict=True)), (said, lost)
    print("recovery_s", [r["recovery_s"] for r in s["restarts"]])
    # The bound (back training within 60 s); a requeue alone waits longer.
    assert all(0 < r["recovery_s"] < 60 for r in s["restarts"]), s["restarts"]
    # The ledger: each attempt's parts sum to its wall time, and each restart is in it, its
    # allocation the previous attempt's.
    for row in rows:
        assert abs(sum(row["seconds"].values()) - row["wall_s"]) <= 0.01 * row["wall_s"], row
    assert rows[0]["restart_in_job"] is None
    for row, r in zip(rows[1:], rs, strict=True):
        back = row["restart_in_job"]
        assert (back["recovery_s"], back["left_out"]) == (r["recovery_s"], r["left_out"]), back
        assert row["sources"]["allocated"] == "previous attempt's end (same allocation)", row
    shown = run_cli("clusterflow.goodput", d, env=env()).stdout
    for a, (rank, host) in enumerate([(1, "node2"), (0, "node1"), (1, "node3")], 1):
        line = f"restart in job: attempt {a} after a crash of rank {rank} on {host}: back training"
        assert line in shown, shown
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))
    # The run completed: its snapshots left the nodes' memory, node3's too, which the last
    # attempt did not run on (the batch step's driver cleared it).
    for node in ("node1", "node2", "node3"):
        assert not os.path.exists(_folder(memory, d, node))


def _each_sample_once(d, n, batch_size):
    """Every epoch's samples trained exactly once, as the task recorded its batches: each
    attempt's batches from where the ledger says it took over to where the next one did."""
    calls = {}
    for name in os.listdir(os.path.join(d, "seen")):
        for r in read_jsonl(os.path.join(d, "seen", name)):
            calls.setdefault((r["attempt"], r["epoch"], r["call"]), []).extend(r["index"])
    seen = {}
    for (attempt, epoch, _), indices in sorted(calls.items()):
        seen.setdefault((attempt, epoch), []).append(sorted(indices))
    bounds = EpochPlan.of(n, batch_size).boundaries()
    ledger = json.load(open(os.path.join(d, "sample_ledger.json")))
    for e in ledger["epochs"]:
        trained = []
        for r in e["ranges"]:
            pos = r["start"]
            for batch in seen[(r["attempt"], e["epoch"])]:
                if pos >= r["end"]:
                    break
                assert len(batch) == bounds[bounds.index(pos) + 1] - pos
                trained += batch
                pos += len(batch)
        assert sorted(trained) == list(range(n)), e["epoch"]
    return ledger


@pytest.mark.slow
def test_a_frozen_rank_is_named_by_its_waiting_peer_and_an_unfit_spare_is_left_out(
    cluster, memory, tmp_path
):
    """Rank 1 SIGSTOPped right after it wrote a heartbeat (the default period, 10 s; the
    watchdog's limit 10 s): the waiting rank 0's watchdog reads the heartbeats and names rank 1,
    whose heartbeat is then 10 to 20 s old (the driver's own reading wanted more than two periods
    and 2 s, 22 s, and blamed rank 0); node2 is left out. The spare node3's memory folder is a
    file: its check before the restart names it and leaves it out, no spare is left, and the job
    goes on alone on node1 (cluster.shrink), every sample once per epoch, as the task recorded
    it; status says it shrank."""
    d = str(tmp_path / "run")
    os.makedirs(memory)
    with open(os.path.join(memory, "node3"), "w") as f:
        f.write("a file where node3's memory folder should be")
    job, out = submit(
        d,
        "cluster.partition=wide",
        "cluster.spare_nodes=1",
        "checkpoint.async=false",
        "checkpoint.memory_every_steps=2",
        f"checkpoint.memory_dir={memory}/{{node}}",
        "task.target=testtasks:SeenSlow",
        f"task.params.run_dir={d}",
        "task.params.step_sleep=0.5",
        "task.params.slow_attempts=1",  # the shrunk attempt after the freeze at full speed
        "train.epochs=6",
        "dist.stall_s=10",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until("step 3", lambda: (live_status(d).get("global_step") or 0) >= 3, job_id=job)
    (first,) = read_jsonl(os.path.join(d, "attempts.jsonl"))
    host, pid, _ = first["procs"][1]
    assert host == "node2" and first["world_size"] == 2
    beat = os.path.join(d, "heartbeats", "rank1.json")
    written = json.load(open(beat))["time"]

    def fresh_in_training():
        rec = json.load(open(beat))
        return rec["time"] > written and rec["phase"] == "train"

    wait_until("a heartbeat of rank 1 in training", fresh_in_training, job_id=job)
    os.kill(pid, signal.SIGSTOP)
    wait_gone(job, timeout=600)

    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 2, s
    rec = first_error.read(rundir.RunPaths(d), 0)
    assert (rec["rank"], rec["host"], rec["silent_rank"], rec["silent_host"]) == (
        0, "node1", 1, "node2",
    ), rec  # fmt: skip
    assert rec["error"].startswith("rank 1 on node2 stopped: no heartbeat for "), rec["error"]
    (r,) = s["restarts"]
    assert (r["cause"], r["rank"], r["host"]) == ("stall", 1, "node2"), r
    assert (r["nodes"], r["left_out"], r["world_size"], r["shrunk"]) == (
        ["node1"], ["node2", "node3"], 1, True,
    ), r  # fmt: skip
    folder = os.path.basename(_folder(memory, d, "node3"))
    assert r["unfit"] == {
        "node3": f"the memory folder {memory}/node3/{folder} is not usable: {memory}/node3 is "
        "not a folder"
    }, r
    assert s["world_size"] == 1 and s["hosts"] == ["node1"], s
    # From node1's replica of rank 1's snapshot, unless the shared filesystem held a state as new
    # (an epoch's end, every 6 steps).
    assert s["restored_from"][0] is None, s["restored_from"]
    assert s["restored_from"][1] == "replica" or (
        s["restored_from"][1] == "shared" and r["restored_step"] % 6 == 0
    ), (s["restored_from"], r)
    shown = run_cli("clusterflow.status", d).stdout
    assert "shrunk to 1 rank(s) on 1 node(s): no spare node was left (cluster.shrink" in shown
    batch_log = open(os.path.join(d, "logs", "slurm", job, f"{job}_0_log.err")).read()
    assert "clusterflow: node node3 left out of the restart: the memory folder " in batch_log
    assert "no spare node left: continuing on 1 of 2 nodes, 1 rank(s) instead of 2" in batch_log
    ledger = _each_sample_once(d, 24 * 8, 32)
    worlds = {(r["attempt"], r["world_size"]) for e in ledger["epochs"] for r in e["ranges"]}
    assert worlds == {(0, 2), (1, 1)}, worlds


def _standbys(batch_log):
    """{node: pids} of each warm standby the driver said was ready, in order."""
    try:
        text = open(batch_log).read()
    except OSError:
        return []
    return [
        {
            n: [int(p) for p in pids.split(", ")]
            for n, pids in re.findall(r"(node\d) \(pid ([\d, ]+)\)", line)
        }
        for line in re.findall(r"warm standby ready: (.*)", text)
    ]


@pytest.mark.slow
def test_warm_restarts_hand_the_ranks_to_a_standby_and_fall_back_when_it_hangs(
    cluster, reference_run, memory, tmp_path
):
    d, gates = str(tmp_path / "run"), tmp_path / "gates"
    gates.mkdir()
    job, out = submit(
        d,
        "cluster.partition=wide",
        "cluster.spare_nodes=1",
        "cluster.warm_restarts=true",  # configs/tiny.yaml keeps none
        "cluster.restarts_in_job=5",
        "checkpoint.async=false",
        "checkpoint.memory_every_steps=2",
        f"checkpoint.memory_dir={memory}/{{node}}",
        "task.target=testtasks:SeenSlow",
        f"task.params.run_dir={d}",
        "task.params.step_sleep=0.3",
        f"task.params.gates={gates}",
        # attempts 0-3: a kill at each one's third loss call (ranks 1, 0, 1, 0), when the test
        # opens its gate; attempt 4 holds at its second call while the test signals the job
        "task.params.kill=0@3/1,1@3/0,2@3/1,3@3/0",
        "task.params.hold=4@2",
        "task.params.slow_attempts=5",  # the requeued attempt after the signal at full speed
    )
    assert out.returncode == 0, out.stdout + out.stderr
    batch_log = os.path.join(d, "logs", "slurm", job, f"{job}_0_log.err")
    frozen = None
    for a in range(5):
        ready = wait_until(
            f"attempt {a}'s warm standby",
            lambda n=a: _standbys(batch_log)[n:],
            timeout=300,
            job_id=job,
        )[0]
        if a == 2:
            # The restart after this kill (of rank 1) runs on rank 0's node: its standby process
            # there hangs.
            attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
            (frozen,) = ready[attempts[2]["procs"][0][0]]
            os.kill(frozen, signal.SIGSTOP)
        if a == 4:  # what Slurm sends ahead of the time limit: rank 0 requeues the job itself
            scmd("scancel", "--signal=USR2", job)
        (gates / str(a)).touch()
    wait_gone(job, timeout=600)

    s = status(d)
    assert s["state"] == "completed" and s["attempts"] == 6, s
    rs = s["restarts"]
    assert [r.get("warm") for r in rs] == [True, True, False, True], rs
    assert [(r["cause"], r["rank"]) for r in rs] == [
        ("crash", 1),
        ("crash", 0),
        ("crash", 1),
        ("crash", 0),
    ]
    batch = open(batch_log).read()
    assert re.search(
        rf"restart 3 in job {job} .*; new processes: the warm standby is not usable: its "
        rf"process 0 on "
        rf"node\d \(pid {frozen}\) did not answer within 3 s \(hung or stopped\)",
        batch,
    ), batch
    stops = read_jsonl(os.path.join(d, "stops.jsonl"))
    assert [x["reason"] for x in stops] == ["timeout"], stops
    attempts = read_jsonl(os.path.join(d, "attempts.jsonl"))
    assert [a["restart_count"] for a in attempts] == [0, 0, 0, 0, 0, 1], attempts
    # The warm ranks are the standby's processes; the output files are the ranks' own.
    standbys = _standbys(batch_log)
    for a, warm in ((1, 0), (2, 1), (4, 3)):
        pids = {pid for pids in standbys[warm].values() for pid in pids}
        assert {pid for _, pid, _ in attempts[a]["procs"]} <= pids, (a, attempts[a], standbys)
    slurm_logs = os.path.join(d, "logs", "slurm", job)
    assert not any(n.startswith(f"{job}_2_") for n in os.listdir(slurm_logs))
    rank1 = open(os.path.join(slurm_logs, f"{job}_1_log.out")).read()
    assert rank1.count("global_rank=1(2)") == 6, rank1
    # Steps lost per crash (as in the first test), at most memory_every_steps.
    calls = {}
    for name in os.listdir(os.path.join(d, "seen")):
        for r in read_jsonl(os.path.join(d, "seen", name)):
            calls[r["attempt"]] = max(calls.get(r["attempt"], 0), r["call"])
    restored = [0] + [r["restored_step"] for r in rs]
    lost = [restored[a] + calls[a] - 1 - restored[a + 1] for a in range(4)]
    assert all(0 <= x <= 2 for x in lost), (lost, restored, calls)
    # Every crash restored from the nodes' memory, unless the shared filesystem held a newer
    # state (an epoch's end, after its mining round: every 6 steps); the requeue after the stop
    # restored from the shared filesystem, where the stop saved.
    for r in rs:
        assert r["restored_from"] in ("memory", "replica") or r["restored_step"] % 6 == 0, r
    assert s["restored_from"][5] == "shared", s["restored_from"]
    ref_dir, _ = reference_run
    assert sha256(os.path.join(d, "model.pt")) == sha256(os.path.join(ref_dir, "model.pt"))
    # No standby process outlives the job; the frozen one was killed.
    for pid in {pid for sb in standbys for pids in sb.values() for pid in pids}:
        assert _gone(pid), pid
    warm = [r["recovery_s"] for r in rs if r["warm"]]
    cold = [r["recovery_s"] for r in rs if not r["warm"]]
    print(
        f"recovery_s warm {warm} (median {statistics.median(warm)}), cold {cold}, "
        f"load average {os.getloadavg()}"
    )
