"""The bare side of benchmarks/own_loop.py's step-based case: a plain DDP script in nanoGPT's
style (torchrun), no Dataset: random rows of a tensor drawn with torch.randint, its own gradient
accumulation (DDP's require_backward_grad_sync), the next micro-batch drawn during the forward, a
fixed number of steps. converted_steps.py is the same script converted to clusterflow."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


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

    dist.init_process_group("gloo")
    joined = time.time()
    rank = dist.get_rank()
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
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ready = time.time()
    t0 = time.perf_counter()
    xb, yb = get_batch()
    for _ in range(args.steps):
        for micro in range(args.accumulation_steps):
            model.require_backward_grad_sync = micro == args.accumulation_steps - 1
            loss = torch.nn.functional.cross_entropy(model(xb), yb) / args.accumulation_steps
            xb, yb = get_batch()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    loop_s, steps, looped = time.perf_counter() - t0, args.steps, time.time()
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()
    if rank == 0:
        at = marks(t_imports=IMPORTED_AT, t_joined=joined, t_ready=ready, t_loop=looped)
        print(f"loop_s={loop_s:.3f} steps={steps} {at} t_end={time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
