"""Training-loop benchmark: clusterflow's loop against a bare DDP loop doing the same work.

    python benchmarks/trainer.py                         # 2, 3 and 4 ranks (CPU: gloo), 2 repeats
    python benchmarks/trainer.py --nproc 2 --repeats 3   # one world size
    python benchmarks/trainer.py --nproc 8 --amp bf16    # a GPU node: one rank per GPU (NCCL)

Both sides run under torchrun with the same number of ranks on configs/demo.yaml's task (the
pseudo-ID demo, ``--identities`` identities x 20 samples, global batch 128, or the multiple of
the world size below it: 126 on 3 ranks): clusterflow as
``python -m clusterflow.run`` with mining and eval off, and the bare loop below (plain
DistributedDataParallel + DistributedSampler + DataLoader + AdamW around ``PseudoIDTask.loss``,
nothing else: no logging, no checkpoints, no stop agreement). Each runs 1 + E epochs and rank 0
notes the time at which every epoch starts and the last one ends (for clusterflow, by wrapping
``Trainer._train_epoch`` and ``Run._end_epoch`` with a clock read, nothing else); the time of
each of epochs 2 to 1 + E is a marginal epoch time, so start-up (imports, rendezvous, building the
data, the first epoch's warm-up) is left out. Repeats are interleaved and alternate the order of the
sides; the best epoch of each side is the claim (the least disturbed by whatever else runs on the
machine: on a shared machine a burst of someone else's work lands in one epoch, not in all of them),
the best run (mean of its E epochs) and the medians are printed beside it, and the load average
before each run shows how busy the machine was. Each world size in ``--nproc`` is measured in
turn; the ratios of every world size are printed again last.

``--buckets`` adds a side with ``dist.fixed_buckets=false`` (DDP rebuilds its buckets after the
first step, as bare DDP does, instead of having them built before it): "ratio clusterflow /
rebuilt-buckets" is what fixed buckets (a bitwise resume with 3 or more ranks) cost a step.

``--heartbeats`` adds a third side, clusterflow with heartbeats and the stall watchdog off (the
clusterflow side runs them every ``--heartbeat-s`` seconds): "ratio clusterflow / no-heartbeat" is
what they cost a step.

clusterflow's figure includes its end-of-epoch checkpoint (the state must be saved somewhere),
written with ``checkpoint.fsync=false``, and no step checkpoints (``checkpoint.every_steps``
larger than the run): fsync on a shared VM disk swings by seconds, so the saves are reported
apart, from the checkpoint/save_s that the runs log, with fsync off and (one extra run) on.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, REPO)


def bare_loop(epochs: int, identities: int, amp: str) -> None:
    """The baseline, run by torchrun on every rank: what a researcher writes by hand."""
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from clusterflow.tasks.pseudo_id import PseudoIDTask

    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tdist.init_process_group("nccl" if cuda else "gloo")
    times = []
    world = tdist.get_world_size()
    torch.manual_seed(0)
    task = PseudoIDTask(seed=0, identities=identities, samples_per_identity=20)
    model = DDP(task.build_model().to(device), device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.002)
    data = task.train_dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(
        data, batch_size=128 // world, sampler=sampler, drop_last=True, pin_memory=cuda
    )
    dtype = {"bf16": torch.bfloat16, "none": None}[amp]
    for epoch in range(epochs):
        times.append(time.perf_counter())
        sampler.set_epoch(epoch)
        task.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss, _ = task.loss(model, batch, None)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter())
    if tdist.get_rank() == 0:
        print("EPOCH_TIMES", *times, flush=True)
    tdist.barrier()
    tdist.destroy_process_group()
    # Leave without interpreter teardown, as clusterflow.run does: gloo's threads can otherwise
    # abort a finished process (SIGABRT, seen once in a few dozen runs here). After the timing.
    sys.stdout.flush()
    os._exit(0)


def clusterflow_rank(argv: list[str]) -> None:
    """clusterflow's side, run by torchrun on every rank: ``python -m clusterflow.run`` itself,
    with the epoch boundaries timed on rank 0."""
    from clusterflow.job import run
    from clusterflow.train.session import Run
    from clusterflow.train.trainer import Trainer

    times: list[float] = []
    train_epoch, end_epoch = Trainer._train_epoch, Run._end_epoch

    def timed_train_epoch(self):
        times.append(time.perf_counter())
        return train_epoch(self)

    def timed_end_epoch(self):
        out = end_epoch(self)
        if self.epoch == self._total_epochs:
            times.append(time.perf_counter())  # the last epoch's end: its checkpoint is committed
        return out

    Trainer._train_epoch, Run._end_epoch = timed_train_epoch, timed_end_epoch
    code = run.main(argv)
    if os.environ.get("RANK") == "0":
        print("EPOCH_TIMES", *times, flush=True)
    run._exit(code)


def torchrun_output(nproc: int, args: list[str]) -> tuple[int, list[str], str]:
    """(exit status, output lines, the command) of one ``torchrun --standalone`` job of ``nproc``
    ranks running ``args``, from the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *args,
    ]
    done = subprocess.run(
        cmd,
        check=False,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return done.returncode, done.stdout.splitlines(), " ".join(cmd)


def torchrun(nproc: int, args: list[str]) -> list[float]:
    """Seconds of each epoch after the first, of one torchrun job (from rank 0's EPOCH_TIMES
    line)."""
    code, output, cmd = torchrun_output(nproc, args)
    lines = [line.split()[1:] for line in output if line.startswith("EPOCH_TIMES")]
    if code or len(lines) != 1 or len(lines[0]) < 3:
        raise SystemExit(f"{cmd} failed ({code}):\n" + "\n".join(output)[-3000:])
    times = [float(t) for t in lines[0]]
    return [b - a for a, b in itertools.pairwise(times[1:])]


def clusterflow_run(
    a: argparse.Namespace,
    epochs: int,
    root: str,
    fsync: bool = False,
    heartbeats: bool = True,
    extra: tuple[str, ...] = (),
) -> tuple[list[float], list[float]]:
    """(seconds of each epoch after the first, the checkpoint/save_s values it logged) of one fresh
    clusterflow run."""
    from clusterflow.observe.metrics import read_metrics

    run_dir = tempfile.mkdtemp(prefix=f"cf-{epochs}-", dir=root)
    overrides = [
        f"run.dir={run_dir}",
        f"task.params.identities={a.identities}",
        f"train.epochs={epochs}",
        f"train.batch_size={global_batch(a.nproc)}",
        "mining.enabled=false",
        "train.eval_every_epochs=0",
        "train.progress_bar=false",
        f"train.amp={a.amp}",
        f"checkpoint.fsync={str(fsync).lower()}",
        "checkpoint.every_steps=100000000",
        *(
            [f"dist.heartbeat_s={a.heartbeat_s}"]
            if heartbeats
            else ["dist.heartbeat_s=0", "dist.stall_s=0"]
        ),
        *extra,
    ]
    seconds = torchrun(
        a.nproc, [os.path.abspath(__file__), "--clusterflow", "configs/demo.yaml", *overrides]
    )
    saves = [
        m["checkpoint/save_s"] for m in read_metrics(run_dir).values() if "checkpoint/save_s" in m
    ]
    shutil.rmtree(run_dir, ignore_errors=True)
    return seconds, saves


def global_batch(world: int) -> int:
    """128, or the multiple of ``world`` below it (every rank takes the same share)."""
    return 128 // world * world


def bare_run(a: argparse.Namespace, epochs: int) -> list[float]:
    return torchrun(
        a.nproc,
        [
            os.path.abspath(__file__),
            "--bare",
            str(epochs),
            f"--identities={a.identities}",
            f"--amp={a.amp}",
        ],
    )


def measure(a: argparse.Namespace, root: str) -> tuple[dict[str, list[list[float]]], list[float]]:
    """Per side, each run's epoch times; and the end-of-epoch save times clusterflow logged."""
    sides = ("clusterflow", "bare") + (("no-heartbeat",) if a.heartbeats else ())
    sides += ("rebuilt-buckets",) if a.buckets else ()
    marginal: dict[str, list[list[float]]] = {side: [] for side in sides}
    saves: list[float] = []
    for r in range(a.repeats):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for side in order:
            load = os.getloadavg()[0]
            if side == "clusterflow":
                seconds, s = clusterflow_run(a, 1 + a.epochs, root)
                saves += s
            elif side == "no-heartbeat":  # heartbeats and the stall watchdog off, all else equal
                seconds, _ = clusterflow_run(a, 1 + a.epochs, root, heartbeats=False)
            elif side == "rebuilt-buckets":  # DDP rebuilds its buckets: no graph walk per step
                extra = ("dist.fixed_buckets=false",)
                seconds, _ = clusterflow_run(a, 1 + a.epochs, root, extra=extra)
            else:
                seconds = bare_run(a, 1 + a.epochs)
            marginal[side].append(seconds)
            print(
                f"  repeat {r + 1} {side:11s} epochs {' '.join(f'{t:.3f}' for t in seconds)} s, "
                f"mean {statistics.mean(seconds):.3f} (load average before: {load:.2f})",
                flush=True,
            )
    return marginal, saves


def report(marginal: dict[str, list[list[float]]], steps: int) -> dict[str, tuple[float, ...]]:
    """Prints each side's figures and its ratios to clusterflow's; returns the ratios (best
    epoch, best run, median epoch) per other side."""
    best: dict[str, dict[str, float]] = {}
    for side, runs in marginal.items():
        epochs = [t for run in runs for t in run]
        means = [statistics.mean(run) for run in runs]
        best[side] = {"epoch": min(epochs), "run": min(means), "median": statistics.median(epochs)}
        print(
            f"{side:11s} best epoch {min(epochs):.3f} s ({steps / min(epochs):.1f} steps/s), best "
            f"run {min(means):.3f} s/epoch, median epoch {statistics.median(epochs):.3f} s, spread "
            f"{min(epochs):.3f}-{max(epochs):.3f}"
        )
    cf = best["clusterflow"]
    ratios = {}
    for other in [side for side in best if side != "clusterflow"]:
        o = best[other]
        ratios[other] = (cf["epoch"] / o["epoch"], cf["run"] / o["run"], cf["median"] / o["median"])
        print(f"ratio clusterflow / {other}: {_ratios(ratios[other])}")
    return ratios


def _ratios(r: tuple[float, ...]) -> str:
    return f"best epoch {r[0]:.3f}x, best run {r[1]:.3f}x, median epoch {r[2]:.3f}x"


def tick_cost_s(n: int = 200_000) -> float:
    """Seconds one ``phases.tick(step)`` costs the loop with a heartbeat attached (what every step
    calls): the writer thread is left out here, its share is in the no-heartbeat side's ratio."""
    from clusterflow.observe.heartbeat import Heartbeat
    from clusterflow.observe.phases import Phases

    with tempfile.TemporaryDirectory() as d:
        tracker, hb = Phases(), Heartbeat(d, 0, every_s=10, start=False)
        tracker.beat = hb.beat
        tracker.set("train")
        t0 = time.perf_counter()
        for step in range(n):
            tracker.tick(step)
        return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nproc",
        type=int,
        nargs="+",
        default=[2, 3, 4],
        help="ranks on this machine, one world size after another (one per GPU on a GPU node)",
    )
    p.add_argument("--epochs", type=int, default=3, help="E: the epochs measured beyond the first")
    p.add_argument("--identities", type=int, default=1000, help="20 samples each; global batch 128")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--amp", default="none", choices=("none", "bf16"))
    p.add_argument(
        "--no-fsync-run", action="store_true", help="skip the extra run that times fsynced saves"
    )
    p.add_argument(
        "--heartbeats",
        action="store_true",
        help="also run clusterflow with heartbeats and the stall watchdog "
        "off (dist.heartbeat_s=0 dist.stall_s=0), side by side: the ratio is their cost",
    )
    p.add_argument(
        "--buckets",
        action="store_true",
        help="also run clusterflow with dist.fixed_buckets=false (DDP rebuilds its buckets "
        "after the first step, no autograd-graph walk per step), side by side: the ratio is what "
        "fixed buckets, and so a bitwise resume with 3+ ranks, cost",
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=10.0,
        help="dist.heartbeat_s of the clusterflow side (default 10)",
    )
    p.add_argument(
        "--bare", type=int, help=argparse.SUPPRESS
    )  # internal: run the bare loop for this many epochs
    if sys.argv[1:2] == [
        "--clusterflow"
    ]:  # internal: a clusterflow rank, with the rest of the command line
        clusterflow_rank(sys.argv[2:])
    a = p.parse_args()
    if a.bare is not None:
        bare_loop(a.bare, a.identities, a.amp)
        return
    import torch

    where = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU, {os.cpu_count()} cores"
    )
    summary = {}
    for world in a.nproc:
        summary[world] = measure_world(argparse.Namespace(**{**vars(a), "nproc": world}), where)
    print(
        "\nclusterflow / each other side, per world size (the default configuration's goal: "
        "<= 1.03x bare DDP):"
    )
    for world, ratios in summary.items():
        for other, r in ratios.items():
            print(f"{world} ranks, clusterflow / {other}: {_ratios(r)}")


def measure_world(a: argparse.Namespace, where: str) -> dict[str, tuple[float, ...]]:
    """One world size, ``a.nproc`` ranks: every side, its figures printed; the ratios."""
    steps = a.identities * 20 // global_batch(a.nproc)
    print(
        f"{a.nproc} ranks ({where}), {steps} steps per epoch, marginal time of epochs "
        f"2-{1 + a.epochs}, {a.repeats} repeats"
    )
    root = tempfile.mkdtemp(prefix="bench-trainer-")
    try:
        marginal, saves = measure(a, root)
        fsynced = [] if a.no_fsync_run else clusterflow_run(a, 1 + a.epochs, root, fsync=True)[1]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = report(marginal, steps)
    if a.heartbeats:
        per_step = min(t for run in marginal["clusterflow"] for t in run) / steps
        tick = tick_cost_s()
        print(
            f"the loop's own heartbeat call: {tick * 1e6:.2f} us per step, "
            f"{100 * tick / per_step:.4f}% of the best epoch's {per_step * 1e3:.2f} ms step"
        )
    print(
        "end-of-epoch save (in clusterflow's epochs), fsync off: median "
        f"{statistics.median(saves):.3f} s of {len(saves)}"
    )
    if fsynced:
        print(
            "the same save with fsync on (not in the figure): median "
            f"{statistics.median(fsynced):.3f} s, max {max(fsynced):.3f} s of {len(fsynced)}"
        )
    return ratios


if __name__ == "__main__":
    main()
