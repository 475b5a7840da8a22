"""A step-counted pretraining-style script on clusterflow's helpers (docs/own-loop.md): run.steps
over epochs, 4 micro-batches a step with run.accumulate, run.autocast, run.print, run.main_first,
and an evaluation gathered with run.gather and run.reduce.

SEEN_DIR: every rank records, for each optimizer step, the indices it trained and how many
gradient reductions each of its micro-batches' backwards made (DDP's comm hook, or FSDP2's
reduce-scatters); HOLD_AT_STEP=k with HOLD_AT_MICRO=m: rank 0 writes SEEN_DIR/held after the m-th
micro-batch of step k and waits there (to be killed between two micro-batches).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

import clusterflow

REDUCES = [0]


class Blobs(Dataset):
    def __init__(self, n: int = 100) -> None:
        g = torch.Generator().manual_seed(0)
        self.y = torch.randint(4, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + 2 * F.one_hot(self.y, 8).float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def counted(model: torch.nn.Module) -> None:
    """Count every gradient reduction the wrapped model makes."""
    if isinstance(model, DistributedDataParallel):

        def hook(state, bucket):
            REDUCES[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
    elif tdist.is_initialized():
        plain = tdist.reduce_scatter_single

        def reduce_scatter(*args, **kwargs):
            REDUCES[0] += 1
            return plain(*args, **kwargs)

        tdist.reduce_scatter_single = reduce_scatter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="samples per rank and micro-batch")
    p.add_argument("--accum", type=int, default=4)
    args = p.parse_args()
    seen = os.environ["SEEN_DIR"]
    hold = (int(os.environ.get("HOLD_AT_STEP", "0")), int(os.environ.get("HOLD_AT_MICRO", "0")))

    run = clusterflow.start()
    with run.main_first():  # rank 0 first: here, a file the others then read
        marker = os.path.join(seen, "prepared")
        if run.is_main:
            with open(marker, "w") as f:
                f.write("ready")
        assert open(marker).read() == "ready"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = run.setup(model, optimizer)
    counted(model)
    loader = run.loader(Blobs(), batch_size=args.batch, accumulate=args.accum)
    run.restore(model=model, optimizer=optimizer)

    log = open(os.path.join(seen, f"rank{run.rank}.jsonl"), "a")
    micro, indices, reduces = 0, [], []
    for x, y, index in run.steps(loader, args.max_steps):
        before = REDUCES[0]
        # The forward too: DDP's no_sync decides in the forward whether its backward reduces.
        with run.accumulate(model):
            with run.autocast():
                loss = F.cross_entropy(model(x), y)
            (loss / args.accum).backward()
        micro += 1
        indices += index.tolist()
        reduces.append(REDUCES[0] - before)
        if run.is_main and (run.global_step + 1, micro) == hold:
            open(os.path.join(seen, "held"), "w").close()
            time.sleep(3600)
        if micro < args.accum:
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step = {"step": run.global_step + 1, "epoch": run.epoch, "index": indices}
        log.write(json.dumps({**step, "pid": os.getpid(), "reduces": reduces}) + "\n")
        log.flush()
        run.step(loss=loss)
        micro, indices, reduces = 0, [], []

    # An evaluation of every rank's share of 99 samples (uneven: 50 and 49 on 2 ranks),
    # gathered and reduced.
    data, n = Blobs(), 99
    mine = torch.arange(run.rank, n, run.world_size)
    with torch.no_grad():
        right = (run.unwrap(model)(data.x[mine]).argmax(1) == data.y[mine]).float()
    everyone = run.gather(right)
    assert everyone.shape == (n,), everyone.shape
    accuracy = run.reduce(right.sum(), "sum") / n
    assert torch.allclose(accuracy, everyone.mean())
    run.print(f"steps {run.global_step}: accuracy {float(accuracy):.3f}")
    run.finish()


if __name__ == "__main__":
    main()
