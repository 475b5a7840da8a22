"""Chaos: one run on the local three-node Slurm cluster (two nodes and a spare) meets faults of
every kind at seeded random times, with nobody typing a command, and must end bitwise equal to an
uninterrupted run.

    flock /tmp/clusterflow-slurm.lock python benchmarks/chaos.py            # every kind
    flock /tmp/clusterflow-slurm.lock python benchmarks/chaos.py --seed 3 --kinds kill,hang

Needs tests/slurm/cluster.sh's cluster (partitions ``wide``: node1..3, and ``high``, which
preempts), root (a tmpfs is mounted for the checkpoint folder) and the test tasks
(``tests/testtasks.py``). First an uninterrupted run of the same config (the reference: its
weights, its wall time); then the chaos run, whose faults come one at a time, each a seeded random
number of seconds of training after the run trained again from the one before:

- ``kill``: SIGKILL of a random rank;
- ``hang``: SIGSTOP of a random rank (its heartbeat thread stops with it; a peer's watchdog names
  it after ``dist.stall_s``);
- ``node``: a node other than the batch step's lost: its ranks and its warm standby SIGKILLed,
  its memory folder emptied and left unusable until the restart has passed it by (its node check
  fails, so it is left out and named); the batch step's own node is not lost here (its loss ends
  the allocation: Slurm's NODE_FAIL requeue). Stopping the node's slurmd instead leaves its
  processes running (their slurmstepd is its own process) until Slurm's SlurmdTimeout (60 s here)
  ends the whole allocation: not the fault this measures;
- ``requeue``: ``scontrol requeue`` of the job, as an admin does;
- ``preempt``: a job of the ``high`` partition on node1, which preempts the run's;
- ``timelimit``: the job's time limit moved to within a minute and a half (``scontrol update
  TimeLimit``): the limit's signal comes ``cluster.signal_delay_s`` before it; the limit is set
  back once the job is queued again;
- ``diskfull``: the shared checkpoint folder (a 64 MB tmpfs mounted for the run) filled by a
  filler file for ``--full-s`` seconds;
- ``poison``: a sample a few steps ahead made to crash the rank that reads it (a segfault in
  native code) every time: the run gives up after three tries of that step, ``failed`` with "no
  progress" and the samples of the batch it died on; the sample is then fixed and the run
  resubmitted with the command ``status`` names: the one command this fault needs, counted.

A hang leaves its node out for the rest of the allocation, so after one, another hang or a node
lost comes only after a requeue, a preemption or a time limit (a fresh allocation): with no spare
left, the restart would shrink the run to one node, which is not bitwise equal to an
uninterrupted run.

Printed per fault: the time from the fault to training again (for a requeue, a preemption and
the time limit: from the signal the ranks got, ``stops.jsonl``, split into Slurm's hold and the
new processes' start-up) and the steps trained again (from ``metrics.jsonl``'s steps, the
timelines' first steps and restored steps, and ``restarts.jsonl``);
for the run: the effective training time (the reference's wall time over the chaos run's) and the
time lost per fault; checked at the end: the weights bitwise equal to the reference, each sample
once per epoch (``RUN_DIR/sample_ledger.json``'s ranges tile every epoch's order), and no command
typed but the poisoned sample's resubmission. ``--json PATH`` writes the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, REPO)

from clusterflow import rundir
from clusterflow.distributed.sampler import EpochPlan, GlobalBatchSampler
from clusterflow.rundir import inflight, restarts, timeline, tries

KINDS = ("kill", "hang", "node", "requeue", "preempt", "timelimit", "diskfull", "poison")
# The faults a restart inside the job cures: each comes once the warm standby is ready (the
# steady state of a run whose faults are minutes or hours apart), so that it measures the warm
# restart, not an attempt's first seconds.
IN_JOB = {"kill", "hang", "node", "diskfull", "poison"}
# A hang leaves its node out for the rest of the allocation; after it, a hang or a node lost
# (which a restart then uses again, having no spare left) must wait for a fresh allocation.
LEAVE_OUT, FRESH = {"hang", "node"}, {"requeue", "preempt", "timelimit"}
SIGNAL_DELAY_S = 30  # cluster.signal_delay_s: the time limit's signal, this long before it
STALL_S = 10  # dist.stall_s: a hang is named this long after the rank stopped moving


@dataclass
class Fault:
    kind: str
    at: float  # when it was injected (seconds since 1970)
    detail: str = ""
    attempt: int = 0  # the attempt it hit
    back_at: float | None = None  # the first training step after it
    back_attempt: int | None = None
    restored_step: int | None = None
    reached_step: int | None = None  # the newest step trained before it
    how: str = ""  # restart in the job, requeue, ...
    recorded: dict[str, Any] = field(default_factory=dict)  # its restarts.jsonl line
    # A stop on a signal (requeue, preemption, time limit): when the ranks got it (stops.jsonl),
    # the fault's moment; then Slurm's hold (the signal to the next attempt's processes) and the
    # new processes' start-up (to their first step).
    signal_at: float | None = None
    hold_s: float | None = None
    startup_s: float | None = None

    @property
    def back_s(self) -> float | None:
        since = self.signal_at if self.signal_at is not None else self.at
        return None if self.back_at is None else round(self.back_at - since, 2)

    @property
    def steps_again(self) -> int | None:
        if self.restored_step is None or self.reached_step is None:
            return None
        return max(0, self.reached_step - self.restored_step)


@dataclass
class Report:
    run_dir: str
    reference_dir: str
    job_ids: list[str]
    faults: list[Fault]
    reference_wall_s: float
    wall_s: float
    step_s: float  # the reference's seconds per training step
    state: str
    bitwise_equal: bool
    each_sample_once: bool
    commands_typed: list[str]
    seed: int

    @property
    def effective(self) -> float:
        return self.reference_wall_s / self.wall_s if self.wall_s else 0.0

    def lost_s(self, f: Fault) -> float | None:
        if f.back_s is None:
            return None
        return round(f.back_s + (f.steps_again or 0) * self.step_s, 2)


def _run(args: list[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(args, capture_output=True, text=True, check=False, cwd=REPO, **kw)
    if check and out.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed: {out.stdout}{out.stderr}")
    return out


def _env() -> dict[str, str]:
    tests = os.path.join(REPO, "tests")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))},
        "PYTHONPATH": tests,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    }


def submit(run_dir: str, overrides: list[str], wait: bool = False) -> str:
    out = _run(
        [
            sys.executable, "-m", "clusterflow.submit", "configs/tiny.yaml", f"run.dir={run_dir}",
            *overrides, *(["--wait"] if wait else []),
        ],
        env=_env(),
    )  # fmt: skip
    m = re.search(r"submitted job (\d+)", out.stdout)
    if not m:
        raise SystemExit(f"no job id in: {out.stdout}{out.stderr}")
    return m.group(1)


def queued(job: str) -> str:
    """squeue's state of ``job`` ("" once it left the queue)."""
    return _run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()


def job_fields(job: str) -> dict[str, str]:
    out = _run(["scontrol", "show", "job", "-o", job], check=False).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip().startswith("{")]
    except OSError:
        return []


def _status(d: str) -> dict[str, Any]:
    try:
        with open(os.path.join(d, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _until(what: str, predicate: Callable[[], Any], timeout: float = 600.0) -> Any:
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Chaos:
    """The chaos run: its config, its faults, what it measured."""

    def __init__(self, a: argparse.Namespace, root: str) -> None:
        self.a, self.root = a, root
        self.rng = random.Random(a.seed)
        self.memory = tempfile.mkdtemp(prefix="cf-chaos-", dir="/dev/shm")
        self.ckfs = os.path.join(root, "ckfs")
        self.poison_file = os.path.join(root, "poison.json")
        self.d = os.path.join(root, "chaos")
        self.paths = rundir.RunPaths(self.d)
        self.jobs: list[str] = []
        self.typed: list[str] = []
        self.faults: list[Fault] = []

    # -- the config ---------------------------------------------------------------------------
    def common(self) -> list[str]:
        """The keys both runs share: the same weights at every step (a resource key or a test
        task's pause changes no number)."""
        a = self.a
        return [
            "cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.time_min=60",
            f"train.epochs={a.epochs}", f"task.params.identities={a.identities}",
            f"mining.every_epochs={a.mining_every}", f"checkpoint.every_steps={a.every_steps}",
            "task.target=testtasks:PoisonedSample", f"task.params.step_sleep={a.step_sleep}",
        ]  # fmt: skip

    def chaos_keys(self) -> list[str]:
        return [
            "cluster.partition=wide", "cluster.spare_nodes=1", "cluster.warm_restarts=true",
            f"cluster.signal_delay_s={SIGNAL_DELAY_S}", "checkpoint.memory_every_steps=2",
            f"checkpoint.memory_dir={self.memory}/{{node}}", f"checkpoint.dir={self.ckfs}/ck",
            f"dist.stall_s={STALL_S}", "dist.heartbeat_s=1",
            f"task.params.poison_file={self.poison_file}",
        ]  # fmt: skip

    # -- the runs -----------------------------------------------------------------------------
    def reference(self) -> tuple[str, float, float]:
        """The uninterrupted run (``--reference``'s, or one run here): (its weights' digest,
        its wall time, its seconds a step)."""
        d = self.a.reference or os.path.join(self.root, "reference")
        self.ref_dir = d
        t0 = time.time()
        if not self.a.reference:
            submit(d, [*self.common(), "cluster.partition=wide"], wait=True)
        if _status(d).get("state") != "completed":
            raise SystemExit(f"the reference run did not complete: {_status(d).get('error')}")
        tl = timeline.read_all(rundir.RunPaths(d)).records[0]
        wall = float(tl["ended_at"]) - float(tl["process_started_at"])
        steps = int(_status(d)["global_step"])
        trained = float(tl["ended_at"]) - float(tl["first_step_at"])
        print(
            f"reference: {steps} steps, wall {wall:.1f} s ({time.time() - t0:.0f} s with the "
            f"queue), {trained / steps:.3f} s a step",
            flush=True,
        )
        return _sha(os.path.join(d, "model.pt")), wall, trained / steps

    def order(self) -> list[str]:
        """The kinds in a seeded order where no two faults that leave a node out come without
        a fresh allocation between them."""
        kinds = [k for k in self.a.kinds if k in KINDS]
        for _ in range(10_000):
            self.rng.shuffle(kinds)
            out, left = True, False
            for k in kinds:
                if k in LEAVE_OUT and left:
                    out = False
                    break
                left = (left or k == "hang") and k not in FRESH
            if out:
                return kinds
        raise SystemExit(f"no order of {kinds} keeps one left-out node per allocation")

    def run(self) -> None:
        os.makedirs(self.ckfs, exist_ok=True)
        _run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", self.ckfs])
        try:
            self._run()
        finally:
            _run(["umount", "-l", self.ckfs], check=False)
            shutil.rmtree(self.memory, ignore_errors=True)

    def _run(self) -> None:
        kinds = self.order()
        print(f"faults in order (seed {self.a.seed}): {', '.join(kinds)}", flush=True)
        self.jobs.append(submit(self.d, [*self.common(), *self.chaos_keys()]))
        for kind in kinds:
            if kind in IN_JOB and self.a.standby_wait_s > 0:
                self._standby_ready()
            self._training_for(self.rng.uniform(*self.a.gap_s))
            if self._ended():
                print(f"the run ended before the {kind} fault", flush=True)
                break
            f = getattr(self, f"_{kind}")()
            self.faults.append(f)
            self._recovered(f)
            print(self._line(f), flush=True)
        _until("the chaos run's end", lambda: not queued(self.jobs[-1]), timeout=1800)

    # -- where the run is ---------------------------------------------------------------------
    def attempts(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.paths.attempts)

    def _attempt(self) -> int:
        return max(0, len(self.attempts()) - 1)

    def _first_step_at(self, attempt: int) -> float | None:
        rec = timeline.read_all(self.paths).records.get(attempt, {})
        return rec.get("first_step_at")

    def _ended(self) -> bool:
        return _status(self.d).get("state") == "completed" or not queued(self.jobs[-1])

    def _batch_log(self) -> str:
        job = self.jobs[-1]
        try:
            with open(os.path.join(self.d, "logs", "slurm", job, f"{job}_0_log.err")) as f:
                return f.read()
        except OSError:
            return ""

    def _standby_ready(self) -> None:
        """Wait (at most ``--standby-wait-s``) until the driver said a warm standby is ready since
        the job's last restart."""

        def ready() -> bool:
            text = self._batch_log()
            last = max(text.rfind("clusterflow: restart "), text.rfind("srun step on "))
            return "warm standby ready:" in text[last:] or self._ended()

        try:
            _until("the warm standby", ready, timeout=self.a.standby_wait_s)
        except SystemExit:
            print("no warm standby ready: the fault meets a cold restart", flush=True)

    def _training_for(self, seconds: float) -> None:
        """Wait until the current attempt trained for ``seconds`` since its first step."""

        def trained() -> bool:
            if self._ended():
                return True
            a = self._attempt()
            first = self._first_step_at(a)
            st = _status(self.d)
            return (
                first is not None
                and st.get("state") == "running"
                and st.get("attempt") == a
                and time.time() - first >= seconds
            )

        _until("training", trained, timeout=900)

    def _recovered(self, f: Fault, timeout: float = 900) -> None:
        """Wait for the first attempt after ``f`` that trains a step; fill in the fault's
        numbers."""

        def back() -> int | None:
            for a in range(f.attempt + 1, self._attempt() + 1):
                first = self._first_step_at(a)
                if first is not None and first > f.at:
                    return a
            return None

        a = _until(f"training again after the {f.kind} fault", back, timeout)
        tl = timeline.read_all(self.paths).records.get(a, {})
        f.back_attempt, f.back_at = a, float(tl["first_step_at"])
        f.restored_step = int(tl.get("restored_step") or 0)
        rows = _read_jsonl(self.paths.metrics)
        steps = [r["step"] for r in rows if "time" in r and r.get("attempt", 0) < a]
        f.reached_step = max(steps) if steps else 0
        rec = [r for r in restarts.read(self.paths) if r.get("next_attempt") == a]
        if rec:
            f.recorded = rec[0]
            warm = {True: ", warm", False: ", new processes"}.get(rec[0].get("warm"), "")
            f.how = f"restart in the job ({rec[0]['cause']}, on {','.join(rec[0]['nodes'])}{warm})"
        elif f.kind != "poison":
            signals = [
                float(x["signal_at"])
                for x in _read_jsonl(self.paths.stops)
                if float(x.get("signal_at") or 0) >= f.at
            ]
            f.signal_at = min(signals) if signals else None
            started = float(tl.get("process_started_at") or f.back_at)
            if f.signal_at is not None:
                f.hold_s = round(started - f.signal_at, 2)
            f.startup_s = round(f.back_at - started, 2)
            f.how = (
                f"requeued: Slurm's hold {f.hold_s} s, start-up {f.startup_s} s"
                if f.hold_s is not None
                else "requeued"
            )

    def _ranks(self) -> tuple[int, list[list[Any]]]:
        """The current attempt and its ranks' [host, pid, ...]."""
        a = self.attempts()
        return len(a) - 1, a[-1]["procs"]

    def _fault(self, kind: str, detail: str, attempt: int) -> Fault:
        return Fault(kind, time.time(), detail, attempt)

    # -- the faults ---------------------------------------------------------------------------
    def _kill(self) -> Fault:
        attempt, procs = self._ranks()
        rank = self.rng.randrange(len(procs))
        host, pid = procs[rank][0], procs[rank][1]
        f = self._fault("kill", f"SIGKILL rank {rank} on {host}", attempt)
        os.kill(pid, signal.SIGKILL)
        return f

    def _hang(self) -> Fault:
        attempt, procs = self._ranks()
        rank = self.rng.randrange(len(procs))
        host, pid = procs[rank][0], procs[rank][1]
        f = self._fault("hang", f"SIGSTOP rank {rank} on {host}", attempt)
        os.kill(pid, signal.SIGSTOP)
        return f

    def _node(self) -> Fault:
        attempt, procs = self._ranks()
        batch = self._batch_node()
        nodes = sorted({p[0] for p in procs} - {batch})
        node = self.rng.choice(nodes)
        f = self._fault("node", f"{node} lost (ranks and standby killed, memory emptied)", attempt)
        for pid in _processes_on(node, self.jobs[-1]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        folder = os.path.join(self.memory, node)
        shutil.rmtree(folder, ignore_errors=True)
        with open(folder, "w") as out:  # unusable until the restart passed it by
            out.write("node lost\n")

        def passed() -> bool:
            return any(r.get("failed_attempt") == attempt for r in restarts.read(self.paths))

        try:
            _until("the restart after the node's loss", passed, timeout=300)
        finally:
            os.remove(folder)
        return f

    def _requeue(self) -> Fault:
        f = self._fault("requeue", f"scontrol requeue {self.jobs[-1]}", self._attempt())
        _run(["scontrol", "requeue", self.jobs[-1]])
        return f

    def _preempt(self) -> Fault:
        f = self._fault("preempt", "a job of partition high on node1", self._attempt())
        _run(
            ["sbatch", "-p", "high", "-N", "1", "-w", "node1", "--exclusive", "-J", "chaos-high",
             "-o", os.path.join(self.root, "high-%j.out"), "--wrap", "sleep 5"]
        )  # fmt: skip
        return f

    def _timelimit(self) -> Fault:
        job = self.jobs[-1]
        run = job_fields(job).get("RunTime", "0:00")
        elapsed = _seconds(run)
        minutes = math.ceil((elapsed + SIGNAL_DELAY_S + 10) / 60)
        f = self._fault(
            "timelimit", f"time limit {minutes} min, {elapsed:.0f} s into the attempt",
            self._attempt(),
        )  # fmt: skip
        _run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"])

        def queued_again() -> bool:
            return queued(job) in ("PENDING", "REQUEUED", "") or self._attempt() > f.attempt

        _until("the time limit's requeue", queued_again, timeout=300)
        _run(["scontrol", "update", f"JobId={job}", "TimeLimit=60"], check=False)
        return f

    def _diskfull(self) -> Fault:
        f = self._fault("diskfull", f"checkpoint folder full for {self.a.full_s:.0f} s", 0)
        f.attempt = self._attempt()
        filler = os.path.join(self.ckfs, "filler")
        free = shutil.disk_usage(self.ckfs).free
        _run(["fallocate", "-l", str(max(0, free - 4096)), filler])
        time.sleep(self.a.full_s)
        os.remove(filler)
        return f

    def _poison(self) -> Fault:
        """A sample of a batch five steps ahead (of what rank 0's in-flight record says it
        trains) crashes its reader from now on; once the run gave up, it is fixed and the run
        resubmitted (the command status names)."""
        n = self.a.identities * 8
        per = n // 32  # no leftover: every epoch has this many steps
        now = inflight.read(self.paths, 0) or {}
        epoch = int(now.get("epoch", 0))
        ahead = int(now.get("step", 1)) - 1 - epoch * per + 5  # the batch's index in its epoch
        if ahead >= per:
            epoch, ahead = epoch + 1, ahead - per
        rank = self.rng.randrange(2)
        plan = GlobalBatchSampler(n, 32, rank, 2, 1)
        plan.set_epoch(epoch, 0, EpochPlan.of(n, 32))
        batch = list(plan)[ahead]
        index = self.rng.choice(batch)
        f = self._fault("poison", f"sample {index} (epoch {epoch + 1}) crashes its reader", 0)
        f.attempt = self._attempt()
        with open(self.poison_file, "w") as out:
            json.dump({"index": index, "epoch": epoch}, out)
        job = self.jobs[-1]
        _until("the run to give up on the poisoned step", lambda: not queued(job), timeout=900)
        f.attempt = self._attempt()  # the last try: training again is the resubmission's
        said = tries.gave_up(self.paths, f.attempt) or ""
        shown = _run([sys.executable, "-m", "clusterflow.status", self.d], env=_env()).stdout
        f.recorded = {"status": said, "named": str(index) in said and "no progress" in shown}
        os.remove(self.poison_file)  # the data fixed
        command = f"python -m clusterflow.submit {self.d}/config.yaml"
        if not said.endswith(command):
            raise SystemExit(f"status did not name the resume command: {said}")
        self.typed.append(command)
        out = _run([sys.executable, "-m", "clusterflow.submit", self.paths.config], env=_env())
        self.jobs.append(re.search(r"submitted job (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
        last = tries.latest(self.paths) or {}
        f.how = (
            f"failed after {last.get('tries')} tries of step {last.get('step')}: no progress; "
            "fixed and resubmitted"
        )
        return f

    def _batch_node(self) -> str:
        """The node of the job's batch step (its driver)."""
        return job_fields(self.jobs[-1]).get("BatchHost", "node1")

    # -- the report ---------------------------------------------------------------------------
    def _line(self, f: Fault) -> str:
        steps = f.steps_again
        return (
            f"{f.kind:>9}: {f.detail}; back training {f.back_s:.1f} s after "
            f"{'the signal it sent' if f.signal_at is not None else 'it'}, "
            f"{steps if steps is not None else '?'} step(s) trained again (step {f.reached_step} "
            f"reached, {f.restored_step} restored), {f.how}"
        )


def _seconds(text: str) -> float:
    """Slurm's [D-]HH:MM:SS (or MM:SS) in seconds."""
    days, _, clock = text.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days) if days else 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def _processes_on(node: str, job: str) -> list[int]:
    """The processes of ``job``'s steps on ``node`` (its ranks, its warm standby; slurmstepd
    has slurmd's environment, not the job's)."""
    out = []
    wanted = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_JOB_ID={job}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if wanted <= env and b"clusterflow.job.restarts" not in cmd:  # never the driver
            out.append(int(pid))
    return out


def each_sample_once(d: str, n: int) -> bool:
    """Every epoch's ranges (sample_ledger.json) tile its order: each sample once."""
    with open(os.path.join(d, "sample_ledger.json")) as f:
        ledger = json.load(f)
    for e in ledger["epochs"]:
        pos = 0
        for r in sorted(e["ranges"], key=lambda r: r["start"]):
            if r["start"] != pos:
                return False
            pos = r["end"]
        if pos != n:
            return False
    return len(ledger["epochs"]) > 0


def chaos(a: argparse.Namespace, root: str) -> Report:
    c = Chaos(a, root)
    digest, ref_wall, step_s = c.reference()
    c.run()
    tls = timeline.read_all(c.paths).records
    start = min(float(t["process_started_at"]) for t in tls.values() if "process_started_at" in t)
    end = max(float(t.get("ended_at") or 0) for t in tls.values())
    st = _status(c.d)
    jobs = sorted({str(x["job_id"]) for x in c.attempts()})
    typed_ok = set(jobs) <= set(c.jobs)
    return Report(
        run_dir=c.d,
        reference_dir=c.ref_dir,
        job_ids=c.jobs,
        faults=c.faults,
        reference_wall_s=round(ref_wall, 2),
        wall_s=round(end - start, 2),
        step_s=round(step_s, 4),
        state=st.get("state", "?"),
        bitwise_equal=st.get("state") == "completed"
        and _sha(os.path.join(c.d, "model.pt")) == digest,
        each_sample_once=each_sample_once(c.d, a.identities * 8),
        commands_typed=c.typed if typed_ok else [*c.typed, f"unknown jobs {jobs}"],
        seed=a.seed,
    )


def show(r: Report) -> None:
    print(f"\n{'fault':>9}  {'back training':>13}  {'steps again':>11}  {'time lost':>9}  how")
    for f in r.faults:
        print(
            f"{f.kind:>9}  {f.back_s:>11.1f} s  {f.steps_again!s:>11}  "
            f"{r.lost_s(f)!s:>7} s  {f.how}"
        )
    lost = [r.lost_s(f) or 0.0 for f in r.faults]
    print(
        f"\nchaos run: {r.state}, wall {r.wall_s:.1f} s against the uninterrupted run's "
        f"{r.reference_wall_s:.1f} s: effective training time {r.effective:.1%}; time lost "
        f"{sum(lost):.1f} s over {len(r.faults)} faults ({sum(lost) / max(1, len(lost)):.1f} s "
        f"a fault, {r.step_s:.3f} s a step)"
    )
    print(
        f"checks: weights bitwise equal to the uninterrupted run: {r.bitwise_equal}; each sample "
        f"once per epoch: {r.each_sample_once}; commands typed: {len(r.commands_typed)} "
        f"({'; '.join(r.commands_typed) or 'none'})"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds")
    p.add_argument("--epochs", type=int, default=14)
    p.add_argument("--identities", type=int, default=96, help="8 samples each, 32 a step")
    p.add_argument("--step-sleep", type=float, default=0.3, help="seconds a step sleeps")
    p.add_argument("--mining-every", type=int, default=2, help="mining.every_epochs")
    p.add_argument("--every-steps", type=int, default=8, help="checkpoint.every_steps")
    p.add_argument(
        "--reference",
        help="an uninterrupted run of the same config (configs/tiny.yaml on two nodes, these "
        "keys) to compare with, instead of running one",
    )
    p.add_argument("--gap-s", type=float, nargs=2, default=(2.0, 5.0),
                   help="seconds of training before each fault: a seeded uniform draw")  # fmt: skip
    p.add_argument("--full-s", type=float, default=60.0, help="the checkpoint folder full")
    p.add_argument(
        "--standby-wait-s",
        type=float,
        default=90.0,
        help="wait at most this long for the warm standby before a fault a restart in the job "
        "cures; 0: do not wait (a short run, whose faults may meet cold restarts)",
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--root", help="a folder for the runs (kept); default: a temporary one")
    a = p.parse_args(argv)
    a.kinds = [k for k in a.kinds.split(",") if k]
    bad = [k for k in a.kinds if k not in KINDS]
    if bad:
        p.error(f"--kinds {','.join(bad)}: not a fault kind; one of {', '.join(KINDS)}")
    return a


def main(argv: list[str] | None = None) -> Report:
    a = parse(argv)
    root = a.root or tempfile.mkdtemp(prefix="cf-chaos-")
    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    r = chaos(a, root)
    show(r)
    print(f"({time.time() - t0:.0f} s in all; runs in {root})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**asdict(r), "effective": r.effective}, f, indent=1, default=str)
    return r


if __name__ == "__main__":
    main()
