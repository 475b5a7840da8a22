"""A step-style loop without real data, as pretraining scripts write it (nanoGPT's train.py): no
dataset, each step's batch drawn at random by a get_batch of its own, a learning-rate schedule
by iteration, settings read from a config file. Run as written it resumes exactly;
tests/test_check.py has `clusterflow check` say so, and name what each flag breaks:

--prefetch: the next batch is drawn before run.step and kept in a variable (nanoGPT as written);
--unregistered-counter: the schedule's iteration counter is the script's own, not passed to
  run.restore;
--config PATH: a JSON file {"lr": ...} read at the start; --rewrite-config-at S: at step S the
  script writes that file anew with another lr (as a script that saves its settings back does).

The loop is run.steps(max_steps): no loader, the step its unit."""

import argparse
import json

import torch

import clusterflow


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", default="")
    p.add_argument("--rewrite-config-at", type=int, default=0)
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--unregistered-counter", action="store_true")
    args = p.parse_args()
    lr = 0.05
    if args.config:
        with open(args.config) as f:
            lr = json.load(f)["lr"]

    run = clusterflow.start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = run.setup(model, optimizer)
    counters = {"iter": 0}
    if args.unregistered_counter:
        run.restore(model=model, optimizer=optimizer)
    else:
        run.restore(model=model, optimizer=optimizer, counters=counters)

    def get_batch():
        x = torch.randn(16, 8)
        return x, torch.sin(x).sum(1, keepdim=True)

    x, y = get_batch() if args.prefetch else (None, None)
    for _ in run.steps(args.steps):
        if not args.prefetch:
            x, y = get_batch()
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.9 ** counters["iter"]
        loss = torch.nn.functional.mse_loss(model(x), y)
        if args.prefetch:
            x, y = get_batch()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        counters["iter"] += 1
        if args.rewrite_config_at and counters["iter"] == args.rewrite_config_at:
            with open(args.config, "w") as f:
                json.dump({"lr": lr / 2}, f)
        run.step(loss=loss)
    run.finish()


if __name__ == "__main__":
    main()
