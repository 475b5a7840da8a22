"""Recovery benchmark: what snapshots in memory cost a step, and what they save at a crash, measured
side by side in one run against the plain alternative.

    python benchmarks/recovery.py                      # both parts, 2 ranks (CPU: gloo)
    python benchmarks/recovery.py --part cost --repeats 3 --hidden 128 1024
    python benchmarks/recovery.py --part crash --kill-at 49
    flock /tmp/clusterflow-slurm.lock python benchmarks/recovery.py --part slurm --kills 4

**cost**: benchmarks/trainer.py's job (configs/demo.yaml's task, ``--identities`` x 20 samples,
global batch 128, mining and eval off, under torchrun) with ``checkpoint.memory_every_steps`` off
and at each of ``--every``, for each model width in ``--hidden`` (``task.params.hidden``: the
encoder's two hidden layers). Runs are interleaved, their order rotated per repeat; each run's
epochs after the first are timed (trainer.py's marginal epoch times), and the best epoch of each
side is the claim, with the best run, the median epoch and the median of each repeat's ratio
(its two runs ran next to each other) beside it. "ratio every N / off" is what the snapshots cost
a step.

**crash**: two local ranks of configs/demo.yaml (one process each, ``task.target`` trains as the
demo and SIGKILLs rank 1 at step ``--kill-at``), then the same command again, which resumes:
once with snapshots every ``--memory-every`` steps (from the memory), once without (from the
shared filesystem's newest checkpoint, ``checkpoint.every_steps`` as configured: 25). Printed for
each: the seconds from the kill to the resumed attempt's first step (a fresh launch of new
processes in both: torch's import included), the steps trained again, and the seconds until the
run is back at the killed step (the first step plus the steps trained again at the run's step
time). A requeue costs the same as the shared-filesystem restart plus its wait in the queue
(hours on a busy cluster; none measured here).

**slurm** (not in ``both``: it needs a Slurm cluster, tests/slurm/cluster.sh's three nodes with
the ``wide`` partition): restarts inside the job, warm against cold. Two jobs of configs/tiny.yaml
on two nodes and a spare, snapshots in memory every 2 steps, one with ``cluster.warm_restarts``
on and one with it off, run one after the other; each kills ranks 1, 0, 1, ... (``--kills``) at
the third loss call of an attempt, the warm job once the driver's standby is ready, the cold job
once the attempt trained its first step. Printed for each side: the seconds from each fault
(srun's report of the kill) to the next attempt's first training step (restarts.jsonl's
``recovery_s``), their median, and the load average; then the warm restarts' start-up phases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import trainer

from clusterflow import rundir
from clusterflow.rundir import restarts, timeline


def cost(a: argparse.Namespace, root: str) -> None:
    """Per model width, each side's marginal epoch times, then the ratios to "off"."""
    memory = tempfile.mkdtemp(prefix="cf-bench-", dir="/dev/shm")
    steps = a.identities * 20 // trainer.global_batch(a.nproc)
    try:
        for hidden in a.hidden:
            sides = ["off", *(f"every {n}" for n in a.every)]
            runs: dict[str, list[list[float]]] = {s: [] for s in sides}
            for r in range(a.repeats):
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                    every = 0 if side == "off" else int(side.split()[1])
                    extra = (
                        f"task.params.hidden={hidden}",
                        f"checkpoint.memory_every_steps={every}",
                        f"checkpoint.memory_dir={memory}",
                    )
                    load = os.getloadavg()[0]
                    seconds, _ = trainer.clusterflow_run(a, 1 + a.epochs, root, extra=extra)
                    runs[side].append(seconds)
                    print(
                        f"  hidden {hidden} repeat {r + 1} {side:9s} epochs "
                        f"{' '.join(f'{t:.3f}' for t in seconds)} s (load average before: "
                        f"{load:.2f})",
                        flush=True,
                    )
            print(f"hidden {hidden}: {_params(hidden)} parameters, {steps} steps per epoch")
            best = {}
            for side, got in runs.items():
                epochs = [t for run in got for t in run]
                best[side] = (
                    min(epochs),
                    min(statistics.mean(run) for run in got),
                    statistics.median(epochs),
                )
                epoch, run, median = best[side]
                print(
                    f"  {side:9s} best epoch {epoch:.3f} s ({epoch / steps * 1e3:.2f} ms/step), "
                    f"best run {run:.3f} s, median epoch {median:.3f} s"
                )
            for side in sides[1:]:
                r = [x / y for x, y in zip(best[side], best["off"])]
                # Each repeat's two runs ran next to each other: their ratio leaves out a drift
                # of the machine's speed between repeats.
                paired = statistics.median(
                    statistics.mean(s) / statistics.mean(o) for s, o in zip(runs[side], runs["off"])
                )
                print(
                    f"  ratio {side} / off: best epoch {r[0]:.3f}x, best run {r[1]:.3f}x, "
                    f"median epoch {r[2]:.3f}x, median of the repeats' pairs {paired:.3f}x"
                )
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def _params(hidden: int) -> int:
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    task = PseudoIDTask(seed=0, identities=10, samples_per_identity=2, hidden=hidden)
    return sum(p.numel() for p in task.build_model().parameters())


def _launch(run_dir: str, overrides: list[str], env: dict[str, str]) -> list[int]:
    """Two local ranks of ``python -m clusterflow.run configs/demo.yaml``; their exit codes."""
    port = str(20000 + os.getpid() % 20000)
    procs = []
    for rank in range(2):
        e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        e.update(env)
        e.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "clusterflow.run", "configs/demo.yaml", *overrides],
                cwd=REPO,
                env=e,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return [p.wait() for p in procs]


def crash(a: argparse.Namespace, root: str) -> None:
    """Kill, resume, measure: from memory, and from the shared filesystem."""
    memory = tempfile.mkdtemp(prefix="cf-bench-", dir="/dev/shm")
    try:
        for side, every in (("memory", a.memory_every), ("shared", 0)):
            d = tempfile.mkdtemp(prefix=f"cf-crash-{side}-", dir=root)
            over = [
                f"run.dir={d}",
                "task.target=testtasks:KillAtEnv",
                "train.epochs=2",
                "train.eval_every_epochs=0",
                "mining.enabled=false",
                "train.progress_bar=false",
                "checkpoint.fsync=false",
                f"checkpoint.memory_every_steps={every}",
                f"checkpoint.memory_dir={memory}",
            ]
            kill = {"CLUSTERFLOW_TEST_KILL_AT": str(a.kill_at), "CLUSTERFLOW_TEST_KILL_RANK": "1"}
            codes = _launch(d, over, kill)
            killed = time.time()  # the second rank ends within a fraction of a second of it
            assert codes[1] == -signal.SIGKILL, codes
            assert _launch(d, over, {}) == [0, 0]
            with open(os.path.join(d, "timeline", "attempt0.json")) as f:
                first = json.load(f)
            with open(os.path.join(d, "timeline", "attempt1.json")) as f:
                second = json.load(f)
            step_s = first["seconds"]["train"] / max(1, first["last_step"] - 1)
            lost = a.kill_at - 1 - second["restored_step"]
            back = second["first_step_at"] - killed
            print(
                f"{side:7s} restored step {second['restored_step']} "
                f"({second.get('restored_from')}) after the kill at step {a.kill_at}: first step "
                f"{back:.2f} s after the kill (restore {second['restore_s']:.3f} s, start-up "
                f"{sum(second['startup'].values()):.2f} s), {lost} step(s) trained again, back at "
                f"the killed step {back + lost * step_s:.2f} s after the kill ({step_s * 1e3:.1f} "
                "ms/step)",
                flush=True,
            )
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def slurm(a: argparse.Namespace, root: str) -> None:
    """Warm and cold restarts inside a Slurm job, side by side."""
    kills = ",".join(f"{k}@3/{1 - k % 2}" for k in range(a.kills))
    got = {}
    for side in ("warm", "cold"):
        d, gates = os.path.join(root, f"slurm-{side}"), os.path.join(root, f"gates-{side}")
        memory = tempfile.mkdtemp(prefix="cf-bench-", dir="/dev/shm")
        os.makedirs(gates)
        out = subprocess.run(
            [
                sys.executable, "-m", "clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}",
                "cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.partition=wide",
                "cluster.spare_nodes=1", f"cluster.restarts_in_job={a.kills}",
                f"cluster.warm_restarts={side == 'warm'}", "checkpoint.async=false",
                "checkpoint.memory_every_steps=2", f"checkpoint.memory_dir={memory}/{{node}}",
                "task.target=testtasks:SeenSlow", f"task.params.run_dir={d}",
                "task.params.step_sleep=0.3", f"task.params.gates={gates}",
                f"task.params.kill={kills}",
            ],
            cwd=REPO, capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")},
        )  # fmt: skip
        job = out.stdout.split("submitted job ")[1].split()[0]
        batch = os.path.join(d, "logs", "slurm", job, f"{job}_0_log.err")
        paths = rundir.RunPaths(d)
        loads = []
        for k in range(a.kills):
            while not _due(side, paths, batch, k):
                if _gone(job):
                    raise SystemExit(f"job {job} ended before kill {k + 1}: see {batch}")
                time.sleep(0.2)
            loads.append(os.getloadavg()[0])
            open(os.path.join(gates, str(k)), "w").close()
        while not _gone(job):
            time.sleep(1)
        rs = restarts.read(paths)
        seconds = [r.get("recovery_s") for r in rs]
        warm = [r.get("warm") for r in rs]
        print(
            f"{side}: {len(rs)} restarts (warm: {warm}), crash to next step "
            f"{' '.join(f'{x:.2f}' for x in seconds if x is not None)} s, median "
            f"{statistics.median([x for x in seconds if x is not None]):.2f} s; load average at "
            f"the kills {' '.join(f'{x:.1f}' for x in loads)}",
            flush=True,
        )
        got[side] = seconds
        tls = timeline.read_all(paths).records
        for r in rs:
            tl = tls.get(r["next_attempt"], {})
            phases = " ".join(f"{k} {v:.2f}" for k, v in tl.get("startup", {}).items())
            to_restart = r["restart_at"] - r["fault_at"]
            print(
                f"  attempt {r['next_attempt']}: fault to restart {to_restart:.2f} s, start-up "
                f"{phases}",
                flush=True,
            )
        shutil.rmtree(memory, ignore_errors=True)
    med = {k: statistics.median([x for x in v if x is not None]) for k, v in got.items()}
    print(
        f"median crash to next step: warm {med['warm']:.2f} s, cold {med['cold']:.2f} s, "
        f"cold / warm {med['cold'] / med['warm']:.2f}x"
    )


def _due(side: str, paths: rundir.RunPaths, batch: str, k: int) -> bool:
    """Whether attempt ``k`` may be killed: its standby ready (warm), its first step (cold)."""
    if side == "warm":
        try:
            return open(batch).read().count("warm standby ready:") > k
        except OSError:
            return False
    try:
        with open(os.path.join(paths.root, "timeline", f"attempt{k}.json")) as f:
            return "first_step_at" in json.load(f)
    except (OSError, ValueError):
        return False


def _gone(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, check=False)
    return not out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("cost", "crash", "both", "slurm"), default="both")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run, after the first")
    p.add_argument("--identities", type=int, default=1000, help="20 samples each")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--every", type=int, nargs="+", default=[10, 50])
    p.add_argument("--memory-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=49)
    p.add_argument("--kills", type=int, default=4, help="--part slurm: kills per job")
    a = p.parse_args()
    a.amp, a.heartbeat_s = "none", 10.0
    root = tempfile.mkdtemp(prefix="cf-recovery-")
    try:
        if a.part in ("cost", "both"):
            cost(a, root)
        if a.part in ("crash", "both"):
            crash(a, root)
        if a.part == "slurm":
            slurm(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
