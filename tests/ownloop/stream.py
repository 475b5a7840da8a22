"""A script over a stream (an IterableDataset with torchdata's state_dict/load_state_dict
convention; docs/own-loop.md): each rank reads its own part of 200 items, in a new shuffled order
each pass; run.steps counts the optimizer steps.

SEEN_DIR: every rank records the item ids of each optimizer step; HOLD_AT_STEP=k: rank 0 writes
SEEN_DIR/held before step k's optimizer step and waits there. --stateless: the same stream without
a state of its own; --workers N: read by N DataLoader workers.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

import clusterflow


class Items(IterableDataset):
    """This rank's part of the stream (items rank, rank + world, ...), a pass in an order drawn
    from the pass's number; its position is its state."""

    def __init__(self, rank: int, world: int, n: int = 200) -> None:
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(4, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + 2 * F.one_hot(self.y, 8).float()
        self.mine = list(range(rank, n, world))
        self.passes, self.pos = 0, 0

    def __iter__(self):
        order = torch.randperm(len(self.mine), generator=torch.Generator().manual_seed(self.passes))
        while self.pos < len(order):
            i = self.mine[order[self.pos]]
            self.pos += 1
            yield self.x[i], self.y[i], i
        self.passes, self.pos = self.passes + 1, 0


class StatefulItems(Items):
    def state_dict(self) -> dict:
        return {"passes": self.passes, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.passes, self.pos = state["passes"], state["pos"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--batch", type=int, default=5, help="items per rank and micro-batch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--stateless", action="store_true")
    p.add_argument("--workers", type=int, default=0, help="the DataLoader's num_workers")
    args = p.parse_args()
    seen = os.environ["SEEN_DIR"]
    hold = int(os.environ.get("HOLD_AT_STEP", "0"))

    run = clusterflow.start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = run.setup(model, optimizer)
    data = (Items if args.stateless else StatefulItems)(run.rank, run.world_size)
    loader = run.loader(
        data, batch_size=args.batch, accumulate=args.accum, num_workers=args.workers
    )
    run.restore(model=model, optimizer=optimizer)

    log = open(os.path.join(seen, f"rank{run.rank}.jsonl"), "a")
    micro, indices = 0, []
    for x, y, index in run.steps(loader, args.max_steps):
        with run.accumulate(model):
            (F.cross_entropy(model(x), y) / args.accum).backward()
        micro += 1
        indices += index.tolist()
        if micro < args.accum:
            continue
        if run.is_main and run.global_step + 1 == hold:
            open(os.path.join(seen, "held"), "w").close()
            time.sleep(3600)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = {"step": run.global_step + 1, "index": indices, "pid": os.getpid()}
        log.write(json.dumps(record) + "\n")
        log.flush()
        run.step()
        micro, indices = 0, []
    run.finish()


if __name__ == "__main__":
    main()
