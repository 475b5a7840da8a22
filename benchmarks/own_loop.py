"""Your own loop: a plain DDP script converted to clusterflow against the same script bare.

    python benchmarks/own_loop.py                      # 2 ranks, 5 pairs of whole runs
    python benchmarks/own_loop.py --pairs 3 --epochs 2 --nproc 4

``benchmarks/own_loop/bare.py`` is a plain DDP script (an MLP on synthetic data, AdamW,
``DistributedSampler``); ``converted.py`` is the same script converted (docs/own-loop.md), with
clusterflow's defaults: the epoch plan, DDP with fixed buckets, a checkpoint every 100 steps and
at each epoch's end (in the background), a log every 10 steps, heartbeats, the stall watchdog,
TensorBoard and status, ``model.pt`` at the end. Each run is a whole ``torchrun`` launch, from
start to the last process's exit (start-up, rendezvous, training, saves, shutdown), the
converted one into a fresh run dir; the two alternate pair by pair (which one goes first too),
so a machine that slows down meanwhile slows both. Each script also prints its training loop's
time (first step to the end of the last epoch, the converted one's end-of-epoch checkpoints
included), which tells the per-step cost from the start-up's. Prints each pair, then the ratios
last: the median of the pairs' ratios and the ratio of the median times (converted / bare), for
whole runs and for the loops alone.
"""

from __future__ import annotations

import argparse
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def whole_run(script: str, nproc: int, args: list[str]) -> tuple[float, float]:
    """Seconds from launching ``torchrun --nproc-per-node nproc script args`` to its exit, in a
    fresh working directory (the converted script's run dir is runs/converted there), and the
    seconds of its training loop (as its rank 0 printed them)."""
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
        t0 = time.perf_counter()
        out = subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if out.returncode != 0:
            sys.exit(
                f"{script} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
            )
    loop = re.search(r"loop_s=([0-9.]+)", out.stdout)
    return seconds, float(loop.group(1)) if loop else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--width", type=int, default=512)
    a = p.parse_args()
    args = ["--epochs", str(a.epochs), "--samples", str(a.samples), "--width", str(a.width)]
    whole_run("bare.py", a.nproc, ["--epochs", "1", "--samples", "1024"])  # warm the caches
    times: dict[str, list[float]] = {"bare.py": [], "converted.py": []}
    loops: dict[str, list[float]] = {"bare.py": [], "converted.py": []}
    ratios, loop_ratios = [], []
    for i in range(a.pairs):
        order = ("bare.py", "converted.py") if i % 2 == 0 else ("converted.py", "bare.py")
        for name in order:
            whole, loop = whole_run(name, a.nproc, args)
            times[name].append(whole)
            loops[name].append(loop)
        ratios.append(times["converted.py"][-1] / times["bare.py"][-1])
        loop_ratios.append(loops["converted.py"][-1] / loops["bare.py"][-1])
        print(
            f"pair {i + 1} ({order[0]} first): whole run bare {times['bare.py'][-1]:.1f} s, "
            f"converted {times['converted.py'][-1]:.1f} s ({ratios[-1]:.3f}x); loop bare "
            f"{loops['bare.py'][-1]:.1f} s, converted {loops['converted.py'][-1]:.1f} s "
            f"({loop_ratios[-1]:.3f}x)",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    loop_med = {k: statistics.median(v) for k, v in loops.items()}
    print(
        f"{a.nproc} ranks, {a.epochs} epochs of {a.samples} samples, width {a.width}: whole run "
        f"median bare {med['bare.py']:.1f} s, converted {med['converted.py']:.1f} s; loop median "
        f"bare {loop_med['bare.py']:.1f} s, converted {loop_med['converted.py']:.1f} s"
    )
    print(
        "whole runs, converted / bare: median of the pairs' ratios "
        f"{statistics.median(ratios):.3f}x, ratio of the medians "
        f"{med['converted.py'] / med['bare.py']:.3f}x"
    )
    print(
        f"loops alone, converted / bare: median of the pairs' ratios "
        f"{statistics.median(loop_ratios):.3f}x, ratio of the medians "
        f"{loop_med['converted.py'] / loop_med['bare.py']:.3f}x"
    )


if __name__ == "__main__":
    main()
