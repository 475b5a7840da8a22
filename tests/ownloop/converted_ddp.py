"""A small classifier on synthetic blobs, trained with DDP (torchrun --nproc-per-node 2 FILE):
SGD with momentum, a step schedule, dropout, a noise augmentation, a look at the first batch of
each epoch (as the PyTorch DDP tutorial prints its batch size). plain_ddp.py is the script as
users arrive with it, converted_ddp.py the same script converted to clusterflow
(docs/own-loop.md); tests/test_own_loop.py counts the lines that differ and runs the
conversion.

For the tests only (environment variables, so the script's arguments stay those of the run):
SEEN_DIR, where every rank records the indices of each batch it trained (what the script saw);
HOLD_AT_STEP, the step at which rank 0 of this process waits (before its run.step) until
SEEN_DIR/release exists; STEP_SLEEP_S, seconds each step sleeps."""

import argparse
import json
import os
import time

import torch
from torch.utils.data import Dataset

import clusterflow


class Blobs(Dataset):
    """n points around c centres in d dimensions; items are (x, label, index)."""

    def __init__(self, n=200, d=8, c=4, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(c, (n,), generator=g)
        self.x = torch.randn(c, d, generator=g)[self.y] * 2 + torch.randn(n, d, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        # Noise from the global stream in the main process (a resume must restore it); in a
        # DataLoader worker, from the item's index: a worker started at a resumed position
        # must give each item what the uninterrupted run's worker gave it.
        worker = torch.utils.data.get_worker_info()
        g = None if worker is None else torch.Generator().manual_seed(int(i))
        return self.x[i] + 0.01 * torch.randn(self.x.shape[1], generator=g), self.y[i], i


steps = 0


def record(rank, epoch, index):
    global steps
    steps += 1
    if os.environ.get("SEEN_DIR"):
        with open(os.path.join(os.environ["SEEN_DIR"], f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": epoch, "pid": os.getpid(), "index": index.tolist()}))
            f.write("\n")
    time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
    if rank == 0 and steps == int(os.environ.get("HOLD_AT_STEP", "0")):
        open(os.path.join(os.environ["SEEN_DIR"], "held"), "w").close()
        while not os.path.exists(os.path.join(os.environ["SEEN_DIR"], "release")):
            time.sleep(0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = p.parse_args()

    run = clusterflow.start()
    rank = run.rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = run.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    dataset = Blobs()
    loader = run.loader(dataset, batch_size=args.batch, num_workers=args.workers)
    run.restore(model=model, optimizer=optimizer, scheduler=scheduler)

    for epoch in run.epochs(args.epochs):
        first = next(iter(loader), None)  # None in an epoch entered again for its mining round
        b_sz = len(first[0]) if first is not None else 0
        print(f"[rank {rank}] epoch {epoch}: {len(loader)} batches of {b_sz} ({loader.batch_size})")
        for x, y, index in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            record(rank, epoch, index)
            run.step(loss=loss)
        run.mine(lambda batch: run.unwrap(model)[:2](batch[0]))
        if rank == 0:
            print(f"epoch {epoch} done")

    run.finish()


if __name__ == "__main__":
    main()
