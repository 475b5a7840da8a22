"""Your own loop: a plain DDP script converted to clusterflow against the same script bare.

    python benchmarks/own_loop.py                      # 2 ranks, 5 pairs of whole runs
    python benchmarks/own_loop.py --pairs 3 --epochs 2 --nproc 4
    python benchmarks/own_loop.py --pairs 0 --fixed-pairs 0 --step-pairs 5   # step-based only

``benchmarks/own_loop/bare.py`` is a plain DDP script (an MLP of three layers, 1536 wide, on
synthetic data, AdamW, ``DistributedSampler``): a step of 64 samples a rank takes tens of
milliseconds on a CPU core, not a toy's one. ``converted.py`` is the same script converted
(docs/own-loop.md), with clusterflow's defaults: the epoch plan, DDP with fixed buckets, a
checkpoint every 100 steps and at each epoch's end (in the background), a log every 10 steps,
heartbeats, the stall watchdog, TensorBoard and status, ``model.pt`` at the end. The step-based
case (``--step-pairs``, ``--steps``) is the same model in nanoGPT's style, ``bare_steps.py``: no
Dataset, rows drawn with ``torch.randint``, two micro-batches a step of its own accumulation,
the next micro-batch drawn during the forward; ``converted_steps.py`` converts it with
``run.steps(max_steps)`` and no loader.

Two measures, each of whole ``torchrun`` launches from start to the last process's exit
(start-up, rendezvous, training, saves, shutdown), the converted one into a fresh run dir, the
two alternating pair by pair (which one goes first too), so a machine that slows down meanwhile
slows both:

- whole runs of about ten seconds (``--epochs``, ``--samples``): the converted over the bare, for
  the whole run and for the training loop alone (first step to the end of the last epoch, as each
  script's rank 0 prints it);
- whole step-based runs (``--step-pairs``, ``--steps``): the same two ratios;
- the fixed cost (``--fixed-pairs``): runs of one step, start to exit; the converted's seconds
  above the bare's, and where they go: each side's :data:`SEGMENTS` (torchrun starting the
  worker, imports, ``clusterflow.start()`` or ``init_process_group``, the model and data, the
  loop, the end, the exit) from marks its rank 0 prints, and the converted's start-up phases as
  its attempt's timeline records them (``RUN_DIR/timeline/attempt0.json``).

Prints the machine's load average (1 minute) before and after: a shared machine's load moves
both sides of a pair, and its spread is in the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "own_loop")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARE, CONVERTED = "bare.py", "converted.py"
BARE_STEPS, CONVERTED_STEPS = "bare_steps.py", "converted_steps.py"
# Where a run's seconds go, from rank 0's marks (each script prints them) and the launch: torchrun
# starting the worker; the script's imports; clusterflow.start() against init_process_group (the
# converted one imports clusterflow's job side here); the model, optimizer, data and restore; the
# loop; the end (run.finish() against the bare's save and destroy_process_group); the process's
# exit as torchrun sees it.
SEGMENTS = ("launcher", "imports", "start", "setup", "loop", "end", "exit")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def whole_run(script: str, nproc: int, args: list[str]) -> dict[str, float]:
    """Seconds from launching ``torchrun --nproc-per-node nproc script args`` to its exit, in a
    fresh working directory (the converted script's run dir is runs/converted there), with what
    its rank 0 printed (``loop_s``, ``steps``, its marks), the :data:`SEGMENTS` between them and,
    for the converted one, its attempt's start-up phases as its timeline recorded them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    with tempfile.TemporaryDirectory(prefix="own-loop-") as cwd:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={_port()}",
            os.path.join(HERE, script),
            *args,
        ]
        t0, launched = time.perf_counter(), time.time()
        out = subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True)
        seconds, exited = time.perf_counter() - t0, time.time()
        if out.returncode != 0:
            sys.exit(
                f"{script} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
            )
        got = {"whole_s": seconds, "t_launch": launched, "t_exit": exited}
        got.update({k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", out.stdout)})
        marks = ["t_launch", "t_start", "t_imports", "t_joined", "t_ready", "t_loop", "t_end"]
        for (a, b), name in zip(zip(marks, [*marks[1:], "t_exit"]), SEGMENTS):
            got[name] = got[b] - got[a]
        name = os.path.splitext(script)[0]
        timeline = os.path.join(cwd, "runs", name, "timeline", "attempt0.json")
        if os.path.exists(timeline):
            record = json.load(open(timeline))
            got.update({f"startup/{k}": v for k, v in record["startup"].items()})
    return got


def pairs(
    count: int,
    nproc: int,
    args: list[str],
    label: str,
    scripts: tuple[str, str] = (BARE, CONVERTED),
) -> dict[str, list[dict[str, float]]]:
    """``count`` pairs of whole runs of both ``scripts`` (bare, converted), alternating which goes
    first; the runs by bare and converted (:data:`BARE`, :data:`CONVERTED`)."""
    bare, converted = scripts
    runs: dict[str, list[dict[str, float]]] = {BARE: [], CONVERTED: []}
    for i in range(count):
        order = (bare, converted) if i % 2 == 0 else (converted, bare)
        for name in order:
            runs[BARE if name == bare else CONVERTED].append(whole_run(name, nproc, args))
        b, c = runs[BARE][-1], runs[CONVERTED][-1]
        print(
            f"{label} pair {i + 1} ({order[0]} first): whole run bare {b['whole_s']:.2f} s, "
            f"converted {c['whole_s']:.2f} s ({c['whole_s'] / b['whole_s']:.3f}x); loop bare "
            f"{b['loop_s']:.2f} s, converted {c['loop_s']:.2f} s "
            f"({c['loop_s'] / b['loop_s']:.3f}x); {b['steps']:.0f} steps",
            flush=True,
        )
    return runs


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs if key in r)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def compiled() -> None:
    """clusterflow's modules byte-compiled, as ``pip install`` leaves them: where the environment
    sets PYTHONDONTWRITEBYTECODE (this project's machines do) a checkout's modules are otherwise
    compiled from source by every process that imports them, about 0.25 s of each converted
    launch that no installed clusterflow pays."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "clusterflow")], check=True
    )
    print("clusterflow's modules byte-compiled (python -m compileall clusterflow)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--fixed-pairs", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--step-pairs", type=int, default=5, help="pairs of the step-based case")
    p.add_argument("--steps", type=int, default=128, help="the step-based case's steps")
    a = p.parse_args()
    print(f"load average (1 min) at the start: {load()}; {os.cpu_count()} CPUs", flush=True)
    width = ["--width", str(a.width)]
    compiled()
    whole_run(BARE, a.nproc, ["--epochs", "1", "--samples", "1024", *width])  # warm the caches
    one_step = ["--epochs", "1", "--samples", str(64 * a.nproc), *width]
    fixed = pairs(a.fixed_pairs, a.nproc, one_step, "one step")
    args = ["--epochs", str(a.epochs), "--samples", str(a.samples), *width]
    runs = pairs(a.pairs, a.nproc, args, "whole run")
    counted = ["--steps", str(a.steps), *width]
    steps = pairs(a.step_pairs, a.nproc, counted, "step-based", (BARE_STEPS, CONVERTED_STEPS))

    if a.pairs:
        report_whole(runs, f"{a.epochs} epoch(s) of {a.samples} samples", a)
    if a.step_pairs:
        report_whole(steps, f"step-based, {a.steps} steps of 2 micro-batches", a)
    if a.fixed_pairs:
        report_fixed(fixed)
    print(f"load average (1 min) at the end: {load()}")


def report_whole(runs: dict[str, list[dict[str, float]]], case: str, a: argparse.Namespace) -> None:
    b, c = runs[BARE], runs[CONVERTED]
    step_ms = 1000 * median(b, "loop_s") / median(b, "steps")
    print(
        f"{a.nproc} ranks, {case}, width {a.width}: a bare "
        f"step {step_ms:.1f} ms; whole run median bare {median(b, 'whole_s'):.2f} s, converted "
        f"{median(c, 'whole_s'):.2f} s; loop median bare {median(b, 'loop_s'):.2f} s, converted "
        f"{median(c, 'loop_s'):.2f} s"
    )
    ratios = [y["whole_s"] / x["whole_s"] for x, y in zip(b, c)]
    loop_ratios = [y["loop_s"] / x["loop_s"] for x, y in zip(b, c)]
    print(
        f"{case}: whole runs, converted / bare: median of the pairs' ratios "
        f"{statistics.median(ratios):.3f}x, ratio of the medians "
        f"{median(c, 'whole_s') / median(b, 'whole_s'):.3f}x"
    )
    print(
        f"{case}: loops alone, converted / bare: median of the pairs' ratios "
        f"{statistics.median(loop_ratios):.3f}x, ratio of the medians "
        f"{median(c, 'loop_s') / median(b, 'loop_s'):.3f}x"
    )


def report_fixed(fixed: dict[str, list[dict[str, float]]]) -> None:
    fb, fc = fixed[BARE], fixed[CONVERTED]
    extra = [y["whole_s"] - x["whole_s"] for x, y in zip(fb, fc)]
    print(
        f"fixed cost (one step, start to exit): median bare {median(fb, 'whole_s'):.2f} s, "
        f"converted {median(fc, 'whole_s'):.2f} s; converted - bare: median of the pairs "
        f"{statistics.median(extra):+.2f} s"
    )
    rows = {
        "where it goes (s), rank 0": [f"{s:>9}" for s in SEGMENTS],
        "bare, median": [f"{median(fb, s):9.2f}" for s in SEGMENTS],
        "converted, median": [f"{median(fc, s):9.2f}" for s in SEGMENTS],
        "converted - bare, median of pairs": [
            f"{statistics.median(y[s] - x[s] for x, y in zip(fb, fc)):+9.2f}" for s in SEGMENTS
        ],
    }
    for label, cells in rows.items():
        print(f"  {label:>33}:" + "".join(cells))
    phases = sorted({k for r in fc for k in r if k.startswith("startup/")}, key=_phase_order)
    where = ", ".join(f"{k.split('/', 1)[1]} {median(fc, k):.2f}" for k in phases)
    print(f"  converted rank 0's timeline (s, from its process's start): {where}")


def _phase_order(key: str) -> int:
    order = ["imports", "rendezvous", "run dir", "task data", "model", "restore", "first batch"]
    name = key.split("/", 1)[1]
    return order.index(name) if name in order else len(order)


if __name__ == "__main__":
    main()
