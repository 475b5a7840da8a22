"""Heartbeat + watchdog benchmark: what per-rank observability costs a training step.

    python benchmarks/heartbeat.py   # small MLP steps on CPU, heartbeat every 0.5 s
    python benchmarks/heartbeat.py --width 2048 --every 0.1 --dir /shared/nfs/scratch

Two loops over the same model and batches, interleaved repeat by repeat in one run: a plain step,
and the same step plus ``hb.beat(step, "train")`` with a Heartbeat writer thread (writing a file
into --dir every --every seconds) and a Watchdog thread running. The printed ratio is the claim.
The heartbeat interval here is far shorter than the default (10 s) to make the writer's share
visible; the loop's own cost is one tuple store and a monotonic clock read per step, also printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import torch

from clusterflow.observe.heartbeat import Heartbeat
from clusterflow.observe.watchdog import StallLimits, Watchdog


def run(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    hb: Heartbeat | None,
) -> float:
    t0 = time.perf_counter()
    for step, x in enumerate(batches, 1):
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if hb is not None:
            hb.beat(step, "train")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--every", type=float, default=0.5, help="heartbeat interval, seconds")
    p.add_argument(
        "--dir", default=None, help="run dir to write heartbeats into (default: a temp dir)"
    )
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(a.width, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, a.width)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(64, a.width) for _ in range(a.steps)]
    run_dir = a.dir or tempfile.mkdtemp(prefix="bench-heartbeat-")
    hb = Heartbeat(run_dir, 0, "bench", a.every)
    wd = Watchdog(hb.progress, run_dir, 0, StallLimits(600)).start()
    run(model, opt, batches[:20], None)  # warm-up
    plain, observed = [], []
    for _ in range(a.repeats):
        plain.append(run(model, opt, batches, None))
        observed.append(run(model, opt, batches, hb))
    wd.stop()
    hb.close()
    n = 1_000_000
    t0 = time.perf_counter()
    for i in range(n):
        hb.beat(i, "train")
    beat_ns = (time.perf_counter() - t0) / n * 1e9
    p_med, o_med = statistics.median(plain), statistics.median(observed)
    print(
        f"step time, plain:             {p_med / a.steps * 1e3:.3f} ms (median of {a.repeats} x "
        f"{a.steps} steps)"
    )
    print(
        f"step time, heartbeat+watchdog: {o_med / a.steps * 1e3:.3f} ms (writer every {a.every} s "
        f"into {run_dir})"
    )
    print(f"ratio observed/plain: {o_med / p_med:.4f}  ({(o_med / p_med - 1) * 100:+.2f} %)")
    print(f"hb.beat() alone: {beat_ns:.0f} ns per call")


if __name__ == "__main__":
    main()
