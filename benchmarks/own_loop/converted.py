"""The converted side of benchmarks/own_loop.py: bare.py converted to clusterflow (the same
training; checkpoints, heartbeats, the watchdog, metrics and status on)."""

import argparse
import time

import torch
from torch.utils.data import TensorDataset

import clusterflow


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    args = p.parse_args()

    run = clusterflow.start()
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = run.setup(model, optimizer)
    dataset = TensorDataset(x, y)
    loader = run.loader(dataset, batch_size=args.batch * run.world_size)
    run.restore(model=model, optimizer=optimizer)

    t0 = time.perf_counter()
    for epoch in run.epochs(args.epochs):
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss=loss)
    if run.rank == 0:
        print(f"loop_s={time.perf_counter() - t0:.3f}", flush=True)

    run.finish()


if __name__ == "__main__":
    main()
