"""Recovery benchmark: what snapshots in memory cost a step, and what they save at a crash, measured
side by side in one run against the plain alternative.

    python benchmarks/recovery.py                      # both parts, 2 ranks (CPU: gloo)
    python benchmarks/recovery.py --part cost --repeats 3 --hidden 128 1024
    python benchmarks/recovery.py --part crash --kill-at 49

**cost**: benchmarks/trainer.py's job (configs/demo.yaml's task, ``--identities`` x 20 samples,
global batch 128, mining and eval off, under torchrun) with ``checkpoint.memory_every_steps`` off
and at each of ``--every``, for each model width in ``--hidden`` (``task.params.hidden``: the
encoder's two hidden layers). Runs are interleaved, their order rotated per repeat; each run's
epochs after the first are timed (trainer.py's marginal epoch times), and the best epoch of each
side is the claim, with the best run and the medians beside it. "ratio every N / off" is what the
snapshots cost a step.

**crash**: two local ranks of configs/demo.yaml (one process each, ``task.target`` trains as the
demo and SIGKILLs rank 1 at step ``--kill-at``), then the same command again, which resumes:
once with snapshots every ``--memory-every`` steps (from the memory), once without (from the
shared filesystem's newest checkpoint, ``checkpoint.every_steps`` as configured: 25). Printed for
each: the seconds from the kill to the resumed attempt's first step (a fresh launch of new
processes in both: torch's import included), the steps trained again, and the seconds until the
run is back at the killed step (the first step plus the steps trained again at the run's step
time). A requeue costs the same as the shared-filesystem restart plus its wait in the queue
(hours on a busy cluster; none measured here). The restarts inside a Slurm job are measured on
the local cluster by tests/test_slurm_recovery.py (its recovery_s), docs/restarts.md has figures.
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
                print(
                    f"  ratio {side} / off: best epoch {r[0]:.3f}x, best run {r[1]:.3f}x, "
                    f"median epoch {r[2]:.3f}x"
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


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("cost", "crash", "both"), default="both")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs per run, after the first")
    p.add_argument("--identities", type=int, default=1000, help="20 samples each")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--every", type=int, nargs="+", default=[10, 50])
    p.add_argument("--memory-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=49)
    a = p.parse_args()
    a.amp, a.heartbeat_s = "none", 10.0
    root = tempfile.mkdtemp(prefix="cf-recovery-")
    try:
        if a.part in ("cost", "both"):
            cost(a, root)
        if a.part in ("crash", "both"):
            crash(a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
