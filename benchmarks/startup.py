"""Start-up benchmark: clusterflow's time to the first step against a bare torchrun script.

    python benchmarks/startup.py                  # 2 ranks, 3 alternated repeats, then the demo
    python benchmarks/startup.py --repeats 5 --no-demo

Both sides are whole ``torchrun --standalone --nproc-per-node 2`` jobs started from this process,
on configs/tiny.yaml's task (the pseudo-ID demo at its tiny size, the same seed, batch size,
learning rate and model): clusterflow as ``python -m clusterflow.run configs/tiny.yaml`` (one
epoch, into a fresh run dir), the bare side as the script below (``init_process_group``, the
task's model wrapped in DistributedDataParallel, AdamW, a DistributedSampler and DataLoader over
the task's dataset, one step: nothing else). Time to first step is from just before the job is
launched to the end of rank 0's first optimizer step (clusterflow: the timeline's
``first_step_at``; the bare script: a clock read after ``opt.step()``). Repeats alternate the
order of the sides; the medians make the claim and the best of each side is printed beside them.

clusterflow's time is split into its start-up phases (``timeline/attempt0.json``'s ``startup``,
rank 0, median over the repeats): imports (interpreter, imports, config), rendezvous, run dir,
task data, model (model, optimizer, loader), restore, first batch, first step.

Last, unless ``--no-demo``: ``submit configs/demo.yaml --local`` once and its goodput line
(``clusterflow goodput``'s ratio and its start-up seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny.yaml")
FIRST_STEP_AT = "FIRST_STEP_AT"


def bare_rank() -> None:
    """The baseline, run by torchrun on every rank: what a researcher writes by hand to train
    configs/tiny.yaml's model on its data."""
    import torch
    import torch.distributed as tdist
    import yaml
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from clusterflow.tasks.pseudo_id import PseudoIDTask

    with open(CONFIG) as f:
        cfg = yaml.safe_load(f)
    seed, train = cfg["run"]["seed"], cfg["train"]
    tdist.init_process_group("gloo")
    world = tdist.get_world_size()
    torch.manual_seed(seed)
    task = PseudoIDTask(seed=seed, **cfg["task"]["params"])
    model = DDP(task.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=train["lr"])
    data = task.train_dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(data, batch_size=train["batch_size"] // world, sampler=sampler)
    sampler.set_epoch(0)
    task.set_epoch(0)
    batch = next(iter(loader))
    loss, _ = task.loss(model, batch, None)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if tdist.get_rank() == 0:
        print(FIRST_STEP_AT, time.time(), flush=True)
    tdist.barrier()
    tdist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as clusterflow.run leaves: no interpreter teardown under gloo's threads


def _torchrun(args: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    """(launch time, the finished job) of one 2-rank ``torchrun --standalone`` job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    t0 = time.time()
    done = subprocess.run(
        [*cmd, *args], check=False, cwd=REPO, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd + args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return t0, done


def bare() -> float:
    t0, done = _torchrun([os.path.abspath(__file__), "--bare-rank"])
    at = [float(line.split()[1]) for line in done.stdout.splitlines() if FIRST_STEP_AT in line]
    return at[0] - t0


def clusterflow(scratch: str, n: int) -> tuple[float, dict[str, float]]:
    run_dir = os.path.join(scratch, f"cf{n}")
    t0, _ = _torchrun(["-m", "clusterflow.run", CONFIG, f"run.dir={run_dir}", "train.epochs=1"])
    with open(os.path.join(run_dir, "timeline", "attempt0.json")) as f:
        rec = json.load(f)
    return rec["first_step_at"] - t0, rec.get("startup", {})


def demo(scratch: str) -> str:
    run_dir = os.path.join(scratch, "demo")
    cmd = [sys.executable, "-m", "clusterflow.submit", "configs/demo.yaml", "--local"]
    subprocess.run(
        [*cmd, f"run.dir={run_dir}"], check=True, cwd=REPO, capture_output=True, text=True
    )
    out = subprocess.run(
        [sys.executable, "-m", "clusterflow.goodput", run_dir, "--json"],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    book = json.loads(out.stdout)
    s = book["total"]["seconds"]
    return (
        f"demo goodput: {book['total']['ratio']:.1%} (start-up {s['startup']:.1f} s, "
        f"productive {s['productive']:.1f} s, mining {s['mining']:.1f} s of "
        f"{book['total']['wall_s']:.1f} s wall)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-demo", action="store_true", help="skip the demo's goodput line")
    p.add_argument("--bare-rank", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bare_rank:
        bare_rank()
    times: dict[str, list[float]] = {"bare": [], "clusterflow": []}
    phases: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="cf-startup-") as scratch:
        for n in range(a.repeats):
            for side in ("bare", "clusterflow") if n % 2 == 0 else ("clusterflow", "bare"):
                load = os.getloadavg()[0]
                if side == "bare":
                    t = bare()
                else:
                    t, split = clusterflow(scratch, n)
                    for k, v in split.items():
                        phases.setdefault(k, []).append(v)
                times[side].append(t)
                print(f"repeat {n} {side:<12} {t:6.2f} s to the first step (load {load:.1f})")
        line = demo(scratch) if not a.no_demo else None
    print(
        "clusterflow's start-up, rank 0, median s: "
        + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in phases.items())
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"median: clusterflow {med['clusterflow']:.2f} s, bare torchrun {med['bare']:.2f} s")
    print(f"best:   clusterflow {best['clusterflow']:.2f} s, bare torchrun {best['bare']:.2f} s")
    if line:
        print(line)
    print(f"ratio clusterflow / bare (best): {best['clusterflow'] / best['bare']:.2f}x")
    print(f"ratio clusterflow / bare (median): {med['clusterflow'] / med['bare']:.2f}x")


if __name__ == "__main__":
    main()
