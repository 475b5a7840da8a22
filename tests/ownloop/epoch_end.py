"""A script with work of its own between the loop over run.loader and the epoch's end, as real
scripts have: a validation pass whose loss goes into a history of the script's own, a random
draw, a per-epoch StepLR stepped after the validation, a counter; then the mining round. The
history, the counter and the scheduler are registered with run.restore, so a resumed run must
end with them exactly as the uninterrupted run does (tests/test_own_loop_edges.py).

For the tests only, environment variables (the script's arguments stay those of the run):
STOP_AT="WHERE:EPOCH:HOW" stops the run once, from rank 0: WHERE is ``last-step`` (just before
the epoch's last run.step), ``after-loop`` (after the script's code that follows the loop, before
run.mine) or ``mine`` (inside the embed function of the epoch's round); HOW is
TERM or INT (a signal rank 0 sends itself) or CANCEL (``clusterflow cancel`` on the run dir).
HOLD_AT_STEP: the step at which rank 0 waits (before its run.step) until HOLD_DIR/release
exists, having created HOLD_DIR/held."""

import argparse
import os
import signal
import subprocess
import sys
import time

import torch
from torch.utils.data import Dataset

import clusterflow


class Blobs(Dataset):
    def __init__(self, n=96, d=8, c=4, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(c, (n,), generator=g)
        self.x = torch.randn(c, d, generator=g)[self.y] * 2 + torch.randn(n, d, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def stop(run, how):
    if how == "CANCEL":
        subprocess.run(
            [sys.executable, "-m", "clusterflow.cancel", run.run_dir], check=True, timeout=120
        )
    else:
        os.kill(os.getpid(), getattr(signal, f"SIG{how}"))


def stop_here(run, where, epoch):
    at, _, rest = os.environ.get("STOP_AT", "").partition(":")
    at_epoch, _, how = rest.partition(":")
    if run.rank == 0 and at == where and at_epoch == str(epoch):
        stop(run, how)
        os.environ.pop("STOP_AT")  # once


def hold(run):
    if run.rank == 0 and run.global_step + 1 == int(os.environ.get("HOLD_AT_STEP", "0")):
        folder = os.environ["HOLD_DIR"]
        open(os.path.join(folder, "held"), "w").close()
        while not os.path.exists(os.path.join(folder, "release")):
            time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="samples of a step, on all ranks")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--skip-mine", type=int, default=-1, help="an epoch without run.mine")
    args = p.parse_args()

    run = clusterflow.start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = run.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    history = {"val": [], "lr": [], "draws": [], "epochs_seen": 0}
    loader = run.loader(Blobs(), batch_size=args.batch, num_workers=args.workers)
    val = Blobs(n=64, seed=2)
    run.restore(model=model, optimizer=optimizer, scheduler=scheduler, history=history)

    for epoch in run.epochs(args.epochs):
        left = len(loader)
        for i, (x, y, _) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            hold(run)
            if i == left - 1:
                stop_here(run, "last-step", epoch)
            run.step(loss=loss)
        # The script's own end of the epoch: each line changes a registered state.
        model.eval()
        with torch.no_grad():
            history["val"].append(
                torch.nn.functional.cross_entropy(run.unwrap(model)(val.x), val.y).item()
            )
        model.train()
        history["draws"].append(torch.rand(1).item())
        history["lr"].append(optimizer.param_groups[0]["lr"])
        scheduler.step()
        history["epochs_seen"] += 1
        stop_here(run, "after-loop", epoch)
        if epoch != args.skip_mine:

            def embed(batch, epoch=epoch):
                stop_here(run, "mine", epoch)
                return run.unwrap(model)[:2](batch[0])

            run.mine(embed)

    run.finish()


if __name__ == "__main__":
    main()
