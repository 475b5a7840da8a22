"""The bare side of benchmarks/own_loop.py: a plain DDP training script (torchrun), an MLP on
synthetic data. converted.py is the same script converted to clusterflow."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    joined = time.time()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 64, generator=g)
    y = (x[:, :8].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 2),
    )
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)

    ready = time.time()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    loop_s, steps, looped = time.perf_counter() - t0, args.epochs * len(loader), time.time()
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()
    if rank == 0:
        at = marks(t_imports=IMPORTED_AT, t_joined=joined, t_ready=ready, t_loop=looped)
        print(f"loop_s={loop_s:.3f} steps={steps} {at} t_end={time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
