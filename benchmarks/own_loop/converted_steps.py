"""The converted side of benchmarks/own_loop.py's step-based case: bare_steps.py converted to
clusterflow (run.steps(max_steps) without a loader; the next step's first micro-batch drawn after
run.step; checkpoints, heartbeats, the watchdog, metrics and status on)."""

import argparse
import os
import time

import torch

import clusterflow


def started_at() -> float:
    """When this process started (Linux /proc), in seconds since 1970."""
    with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat", encoding="ascii") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


IMPORTED_AT = time.time()


def marks(**at: float) -> str:
    """``name=seconds since 1970`` for benchmarks/own_loop.py, which tells where the time went."""
    return " ".join(f"{k}={v:.3f}" for k, v in {"t_start": started_at(), **at}.items())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and micro-batch")
    p.add_argument("--accumulation-steps", type=int, default=2)
    args = p.parse_args()

    run = clusterflow.start()
    joined = time.time()
    rank = run.rank
    torch.manual_seed(1337 + rank)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 64, generator=g)
    y = (x[:, :8].sum(1) > 0).long()

    def get_batch():
        ix = torch.randint(args.samples, (args.batch,))
        return x[ix], y[ix]

    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 2),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = run.setup(model, optimizer)
    run.restore(model=model, optimizer=optimizer)

    ready = time.time()
    t0 = time.perf_counter()
    for _ in run.steps(args.steps):
        xb, yb = get_batch()
        for micro in range(args.accumulation_steps):
            model.require_backward_grad_sync = micro == args.accumulation_steps - 1
            loss = torch.nn.functional.cross_entropy(model(xb), yb) / args.accumulation_steps
            if micro < args.accumulation_steps - 1:
                xb, yb = get_batch()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step(loss=loss)
    loop_s, steps, looped = time.perf_counter() - t0, run.global_step, time.time()
    run.finish()
    if rank == 0:
        at = marks(t_imports=IMPORTED_AT, t_joined=joined, t_ready=ready, t_loop=looped)
        print(f"loop_s={loop_s:.3f} steps={steps} {at} t_end={time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
