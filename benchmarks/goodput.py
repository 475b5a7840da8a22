"""Goodput with restart inside the allocation vs requeue, on a Slurm cluster with faults injected on
a schedule.

    python benchmarks/goodput.py                          # partition wide: 2 nodes (+1 spare)
    python benchmarks/goodput.py --faults 10,25 --queue-s 30 --epochs 6 --step-sleep 0.3

Two runs of the same config (configs/tiny.yaml, one task per node, tests/testtasks.py's Slow task:
``--step-sleep`` seconds per step), one after the other in one invocation:

- ``in-job``: ``cluster.restarts_in_job=2 cluster.spare_nodes=1``;
- ``requeue``: ``cluster.restarts_in_job=0``: a crashed rank ends the job, which is submitted
  again at once (what a requeue does), and waits in the queue.

At each global step of ``--faults``, rank 1's process is SIGKILLed (for real), and a competing
job (``sbatch --exclusive --wrap 'sleep QUEUE_S'`` on all the partition's nodes) is submitted at
that moment: it takes the nodes when they are freed, so a job that leaves its allocation waits
``--queue-s`` behind it; a job that restarts inside its allocation does not.

Printed per mode: wall time (first submission to the end), the time from each fault to the next
training step (status.json polled every 0.1 s), productive training seconds (the sum of
``perf/step_time_s`` over the steps of the final weights' lineage in metrics.jsonl: a step trained
again after a restore counts once), goodput = productive / wall, and goodput per allocated
node-second (productive x nodes / the job's running seconds x allocated nodes); then the ratios
in-job / requeue. Both runs must end with bitwise equal model.pt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TESTS = os.path.join(REPO, "tests")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    e["PYTHONPATH"] = os.pathsep.join([os.path.abspath(REPO), TESTS])
    return e


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def read_jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def submit(run_dir: str, args: argparse.Namespace, mode: str) -> str:
    extra = (
        ["cluster.restarts_in_job=2", "cluster.spare_nodes=1"]
        if mode == "in-job"
        else ["cluster.restarts_in_job=0"]
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            f"run.dir={run_dir}",
            "cluster.nodes=2",
            "cluster.tasks_per_node=1",
            "cluster.time_min=10",
            f"cluster.partition={args.partition}",
            "task.target=testtasks:Slow",
            f"task.params.step_sleep={args.step_sleep}",
            f"train.epochs={args.epochs}",
            "checkpoint.async=false",
            *extra,
        ],
        check=False,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    )
    m = re.search(r"submitted job (\d+)", out.stdout)
    if not m:
        sys.exit(f"submit failed: {out.stdout}{out.stderr}")
    return m.group(1)


def queue_state(job: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], check=False, capture_output=True, text=True
    )
    return out.stdout.strip()


def compete(args: argparse.Namespace) -> str:
    out = subprocess.run(
        [
            "sbatch",
            "-p",
            args.partition,
            "-N",
            str(args.partition_nodes),
            "--exclusive",
            "-o",
            "/dev/null",
            "--time=10",
            "--wrap",
            f"sleep {args.queue_s}",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    return out.stdout.split()[-1]


def run_mode(mode: str, root: str, args: argparse.Namespace) -> dict:
    d = os.path.join(root, mode)
    faults = sorted(int(s) for s in args.faults.split(","))
    t0 = time.time()
    jobs = [submit(d, args, mode)]
    running: dict[str, list[float]] = {}  # job -> [first seen running, last seen running]
    competitors, fault_at, recovered = [], [], []
    waiting_since: float | None = None
    resume_attempt = -1
    while True:
        now = time.time()
        job = jobs[-1]
        q = queue_state(job)
        if q == "RUNNING":
            running.setdefault(job, [now, now])[1] = now
        s = read_json(os.path.join(d, "status.json"))
        step, attempt = int(s.get("global_step") or 0), int(s.get("attempt") or 0)
        if waiting_since is not None and attempt > resume_attempt and s.get("state") == "running":
            # the first step the next attempt trained (status.json is rewritten every step)
            first = read_jsonl(os.path.join(d, "metrics.jsonl"))
            if any(r.get("attempt") == attempt and "train/loss" in r for r in first):
                recovered.append(now - waiting_since)
                waiting_since = None
        if faults and step >= faults[0] and waiting_since is None and s.get("state") == "running":
            procs = read_jsonl(os.path.join(d, "attempts.jsonl"))[-1]["procs"]
            os.kill(procs[1][1], signal.SIGKILL)
            waiting_since, resume_attempt = time.time(), attempt
            fault_at.append(waiting_since)
            faults.pop(0)
            competitors.append(compete(args))
        if q == "" and time.time() - t0 > 5:
            state = read_json(os.path.join(d, "status.json")).get("state")
            if state == "completed":
                break
            if mode == "requeue" and state in ("failed", "running"):
                jobs.append(submit(d, args, mode))  # what a requeue does: back into the queue
                continue
            sys.exit(f"{mode}: job {job} ended {state}; see {d}")
        time.sleep(0.1)
    wall = time.time() - t0
    for c in competitors:
        subprocess.run(["scancel", c], check=False, capture_output=True)
    lineage: dict[int, float] = {}
    for r in read_jsonl(os.path.join(d, "metrics.jsonl")):
        if "perf/step_time_s" in r:
            lineage[r["step"]] = r["perf/step_time_s"]  # a later attempt's record replaces it
    productive = sum(lineage.values())
    nodes = 3 if mode == "in-job" else 2
    allocated = sum((b - a) * nodes for a, b in running.values())
    with open(os.path.join(d, "model.pt"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {
        "mode": mode,
        "jobs": len(jobs),
        "wall_s": wall,
        "recovery_s": recovered,
        "productive_s": productive,
        "goodput": productive / wall,
        "goodput_alloc": productive * 2 / allocated if allocated else float("nan"),
        "model": digest,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default="10,25", help="global steps at which rank 1 is killed")
    p.add_argument("--queue-s", type=int, default=30, help="how long the competing job runs")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--step-sleep", type=float, default=0.3)
    p.add_argument("--partition", default="wide")
    p.add_argument("--partition-nodes", type=int, default=3)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="goodput-")
    rows = [run_mode(m, root, args) for m in ("in-job", "requeue")]
    print(
        f"faults at steps {args.faults}, competing job {args.queue_s} s, {args.epochs} epochs of "
        f"6 steps, {args.step_sleep} s sleep per step; run dirs under {root}"
    )
    print(
        f"{'mode':8} {'jobs':>4} {'wall s':>7} {'fault->step s':>16} {'productive s':>12} "
        f"{'goodput':>8} {'per node-s':>10}"
    )
    for r in rows:
        rec = ",".join(f"{x:.1f}" for x in r["recovery_s"])
        print(
            f"{r['mode']:8} {r['jobs']:>4} {r['wall_s']:>7.1f} {rec:>16} "
            f"{r['productive_s']:>12.1f} {r['goodput']:>8.3f} {r['goodput_alloc']:>10.3f}"
        )
    a, b = rows
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    print(
        f"ratios in-job/requeue: wall {a['wall_s'] / b['wall_s']:.2f}x, fault->step "
        f"{mean(a['recovery_s']) / mean(b['recovery_s']):.2f}x, goodput "
        f"{a['goodput'] / b['goodput']:.2f}x, goodput per allocated node-s "
        f"{a['goodput_alloc'] / b['goodput_alloc']:.2f}x"
    )
    print(f"model.pt bitwise equal across modes: {a['model'] == b['model']}")


if __name__ == "__main__":
    main()
