"""A script with two models (a small GAN: a generator and a discriminator, each set up with its own
optimizer), an EMA of the generator's weights kept by the script (a dict of tensors: shards under
train.parallel=fsdp), and optionally torch.compile before or after run.setup (docs/own-loop.md).

SEEN_DIR: rank 0 writes, at the start of each attempt, the EMA it begins from (gathered whole:
``start-step<k>.pt``, k the step restored, 0 on a fresh start), and after each step the EMA
(``ema-step<k>.pt``), the discriminator's weights (``d-step<k>.pt``); HOLD_AT_STEP=k: rank 0
writes SEEN_DIR/held before step k's optimizer steps and waits there.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

import clusterflow


class Points(Dataset):
    """Points on a ring: what the generator learns to draw."""

    def __init__(self, n: int = 96) -> None:
        angle = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 6.283
        self.x = torch.stack([angle.cos(), angle.sin()], 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def mlp(n_in: int, n_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32, n_out),
    )


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="points per rank and step")
    p.add_argument("--compile", choices=["none", "before", "after"], default="none")
    args = p.parse_args()
    seen = os.environ["SEEN_DIR"]
    hold = int(os.environ.get("HOLD_AT_STEP", "0"))

    run = clusterflow.start()
    torch.manual_seed(0)
    g, d = mlp(4, 2), mlp(2, 1)
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.9))
    if args.compile == "before":
        g = torch.compile(g)
    g, opt_g = run.setup(g, opt_g)
    d, opt_d = run.setup(d, opt_d)
    if args.compile == "after":
        g = torch.compile(g)
    ema = {n: q.detach().clone() for n, q in run.unwrap(g).named_parameters()}
    noise = torch.Generator().manual_seed(100 + run.rank)
    loader = run.loader(Points(), batch_size=args.batch)
    run.restore(model=g, optimizer=opt_g, discriminator=d, opt_d=opt_d, ema=ema, noise=noise)
    whole_ema = {n: whole(t) for n, t in ema.items()}
    if run.is_main:
        torch.save(whole_ema, os.path.join(seen, f"start-step{run.global_step}.pt"))

    for _ in run.epochs(args.epochs):
        for real in loader:
            z = torch.randn(len(real), 4, generator=noise)
            fake = g(z)
            # One forward of each model a step (DDP reduces one backward per forward).
            score = d(torch.cat([fake.detach(), real]))
            d_loss = F.softplus(score[: len(real)]).mean() + F.softplus(-score[len(real) :]).mean()
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            if run.is_main and run.global_step + 1 == hold:
                open(os.path.join(seen, "held"), "w").close()
                time.sleep(3600)
            opt_d.step()
            g_loss = F.softplus(-d(fake)).mean()
            opt_g.zero_grad(set_to_none=True)
            g_loss.backward()
            opt_g.step()
            with torch.no_grad():
                for n, q in run.unwrap(g).named_parameters():
                    ema[n].lerp_(q.detach(), 0.1)
            run.step(loss=g_loss, metrics={"d_loss": d_loss})
            whole_ema = {n: whole(t) for n, t in ema.items()}
            whole_d = {n: whole(t) for n, t in run.unwrap(d).state_dict().items()}
            if run.is_main:
                torch.save(whole_ema, os.path.join(seen, f"ema-step{run.global_step}.pt"))
                torch.save(whole_d, os.path.join(seen, f"d-step{run.global_step}.pt"))
    run.finish()


if __name__ == "__main__":
    main()
