"""What the non-finite guard costs per optimizer step, against the same loop without it.

    python benchmarks/nonfinite.py                         # MLP on this machine's device
    python benchmarks/nonfinite.py --width 4096 --layers 8 --batch 256 --device cuda

Three loops over the same model, batches and AdamW, interleaved repeat by repeat in one run:

- plain: forward, backward, optimizer step (the trainer's step without the guard);
- fail (the default policy): plus ``FiniteGuard.observe`` on every step (two tiny device ops, no
  host read) and ``check`` every ``--log-every`` steps (one host read), as the trainer does at log
  steps;
- skip_step: plus ``FiniteGuard.step_ok`` before every optimizer step (the gradients' finiteness,
  one host read per step).

The printed ratios (median step time against plain) are the claim. On a GPU the host read of
skip_step waits for the step's kernels, so the CPU can no longer queue the next step ahead; that
is the cost the fail policy avoids.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from clusterflow.train.finite import FiniteGuard


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(policy: str, model, opt, data, device, steps: int, log_every: int) -> float:
    """Seconds per step over ``steps`` steps."""
    train = SimpleNamespace(on_nonfinite=policy, grad_accum=1, max_consecutive_skips=10, lr=1e-3)
    guard = FiniteGuard(device, train, list)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    sync(device)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = data[step % len(data)]
        loss = model(x).square().mean()
        loss.backward()
        if policy != "plain":
            guard.observe(loss)
        if policy != "skip_step" or guard.step_ok(model.parameters(), scaler, step):
            opt.step()
        opt.zero_grad(set_to_none=True)
        if policy == "fail" and step % log_every == 0:
            guard.check(step)
    sync(device)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: steadier timings on a shared machine)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    layers = [
        m
        for _ in range(args.layers)
        for m in (torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
    ]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [torch.randn(args.batch, args.width, device=device) for _ in range(8)]
    policies = ("plain", "fail", "skip_step")
    run("plain", model, opt, data, device, 10, args.log_every)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in policies}
    for _ in range(args.repeats):
        for policy in policies:
            times[policy].append(run(policy, model, opt, data, device, args.steps, args.log_every))
    params = sum(t.numel() for t in model.parameters())
    print(
        f"{device}, {params / 1e6:.1f}M parameters, batch {args.batch}, {args.steps} steps x "
        f"{args.repeats} repeats"
    )
    base = statistics.median(times["plain"])
    for policy in policies:
        med, best = statistics.median(times[policy]), min(times[policy])
        print(
            f"{policy:10s} median {med * 1e3:8.3f} ms/step  best {best * 1e3:8.3f}  ratio vs plain "
            f"{med / base:.3f}x"
        )


if __name__ == "__main__":
    main()
