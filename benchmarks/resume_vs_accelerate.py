"""Resuming in mid-epoch: Accelerate's documented checkpointing pattern against clusterflow, on the
same small script, side by side.

    pip install accelerate            # 1.15.0 measured; not a clusterflow dependency
    python benchmarks/resume_vs_accelerate.py
    python benchmarks/resume_vs_accelerate.py --samples 64 --batch 4 --epochs 3 --stop-after 5

The script: a linear model trained with SGD on ``--samples`` items in batches of ``--batch``
(one process, CPU), shuffled every epoch, for ``--epochs`` epochs; every item carries its index,
and each run records the indices of every batch it trains. Each way runs it three times, each in
a process of its own: uninterrupted; stopped after ``--stop-after`` batches of the second epoch;
resumed from that stop to the end. What the printed table compares, in the interrupted epoch
(before the stop and after the resume together): the samples trained twice and never; whether the
batches after the resume are the uninterrupted run's, in its order; whether the final weights are
bitwise the uninterrupted run's.

- Accelerate (``accelerate`` documentation, "Checkpointing" and the ``by_feature/checkpointing.py``
  example): ``accelerator.save_state(dir)`` in mid-epoch, with the epoch and the batches done kept
  beside it (the example reads them from the folder's name); on resume
  ``accelerator.load_state(dir)``, then ``accelerator.skip_first_batches(loader, batches done)``
  for the rest of that epoch; ``set_seed`` at the start. Run three times: as the example is
  (the default sampler), with ``DataLoaderConfiguration(use_seedable_sampler=True)``, and with
  that and ``loader.set_epoch(epoch)`` at each epoch's start.
- clusterflow (docs/own-loop.md): the converted script; the stop is a SIGTERM the script sends
  itself before the batch's ``run.step``, the resume the same command again.

The counts are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Indexed(Dataset):
    """``n`` random items of 8 features and a label; an item is (x, y, its index)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _record(out: str, epoch: int, index: torch.Tensor) -> None:
    with open(os.path.join(out, "seen.jsonl"), "a") as f:
        f.write(json.dumps({"epoch": epoch, "index": index.tolist()}) + "\n")


def accelerate_run(a: argparse.Namespace, phase: str, seedable: bool, set_epoch: bool) -> None:
    """One process of Accelerate's documented pattern: ``full``, ``first`` (until the stop: save
    and leave) or ``resume``."""
    from accelerate import Accelerator  # an optional package, only for this side
    from accelerate.utils import DataLoaderConfiguration, set_seed

    set_seed(0)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable)
    )
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Indexed(a.samples), batch_size=a.batch, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    ckpt = os.path.join(a.out, "checkpoint")
    start, done = 0, 0
    if phase == "resume":
        accelerator.load_state(ckpt)
        with open(os.path.join(a.out, "where.json")) as f:
            where = json.load(f)
        start, done = where["epoch"], where["batches"]
    for epoch in range(start, a.epochs):
        if set_epoch:
            loader.set_epoch(epoch)
        active = (
            accelerator.skip_first_batches(loader, done)
            if phase == "resume" and epoch == start and done
            else loader
        )
        for i, (x, y, index) in enumerate(active):
            _step(model, opt, x, y)
            _record(a.out, epoch, index)
            if phase == "first" and epoch == 1 and i + 1 == a.stop_after:
                accelerator.save_state(ckpt)
                with open(os.path.join(a.out, "where.json"), "w") as f:
                    json.dump({"epoch": epoch, "batches": i + 1}, f)
                return
    torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(a.out, "model.pt"))


def clusterflow_run(a: argparse.Namespace, phase: str) -> None:
    """One process of the converted script; ``first`` stops itself with a SIGTERM before the
    ``run.step`` of the stop's batch (the same command resumes it)."""
    import clusterflow

    run = clusterflow.start(run={"dir": os.path.join(a.out, "run")})
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = run.setup(model, opt)
    loader = run.loader(Indexed(a.samples), batch_size=a.batch)
    run.restore(model=model, optimizer=opt)
    stop_at = (a.samples // a.batch) + a.stop_after if phase == "first" else 0
    for epoch in run.epochs(a.epochs):
        for x, y, index in loader:
            loss = _step(model, opt, x, y)
            _record(a.out, epoch, index)
            if run.global_step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # a preemption at this step
            run.step(loss=loss)
    run.finish()


def _phase(way: str, phase: str, a: argparse.Namespace, out: str) -> None:
    """``way``'s ``phase`` in a process of its own, its records into ``out``."""
    os.makedirs(out, exist_ok=True)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--samples={a.samples}",
        f"--batch={a.batch}",
        f"--epochs={a.epochs}",
        f"--stop-after={a.stop_after}",
        f"--out={out}",
        f"--way={way}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, CF_PHASE=phase)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(command, check=False, env=env, capture_output=True, text=True, cwd=out)
    if r.returncode != 0:
        sys.exit(f"{way} {phase} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")


def _seen(out: str) -> list[tuple[int, list[int]]]:
    with open(os.path.join(out, "seen.jsonl")) as f:
        return [(r["epoch"], r["index"]) for r in map(json.loads, f)]


def _weights(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def compare(way: str, a: argparse.Namespace, root: str) -> dict[str, object]:
    """``way`` uninterrupted, stopped and resumed: what the interrupted epoch trained twice and
    never, whether the resumed batches and the final weights are the uninterrupted run's."""
    full, cut = os.path.join(root, way, "full"), os.path.join(root, way, "cut")
    _phase(way, "full", a, full)
    _phase(way, "first", a, cut)
    before = len(_seen(cut))
    _phase(way, "resume", a, cut)
    plain, interrupted = _seen(full), _seen(cut)
    trained = [i for epoch, idx in interrupted if epoch == 1 for i in idx]
    final = os.path.join("run", "model.pt") if way == "clusterflow" else "model.pt"
    w, ref = _weights(os.path.join(cut, final)), _weights(os.path.join(full, final))
    return {
        "twice": len(trained) - len(set(trained)),
        "never": a.samples - len(set(trained)),
        "order": interrupted[before:] == plain[before:],
        "weights": w.keys() == ref.keys() and all(torch.equal(w[k], ref[k]) for k in w),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--stop-after", type=int, default=5, help="batches of the second epoch")
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--way", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.way:  # one phase, in its own process
        phase = os.environ["CF_PHASE"]
        if a.way == "clusterflow":
            clusterflow_run(a, phase)
        else:
            accelerate_run(a, phase, seedable="seedable" in a.way, set_epoch="epoch" in a.way)
        return
    import accelerate

    ways = ("accelerate", "accelerate-seedable", "accelerate-seedable-epoch", "clusterflow")
    with tempfile.TemporaryDirectory(prefix="resume-vs-accelerate-") as root:
        results = {way: compare(way, a, root) for way in ways}
    per_epoch = a.samples // a.batch
    print(
        f"{a.samples} samples in batches of {a.batch} ({per_epoch} a step each epoch), "
        f"{a.epochs} epochs, one process; stopped after {a.stop_after} of the {per_epoch} "
        f"batches of epoch 2 and resumed (accelerate {accelerate.__version__})"
    )
    names = {
        "accelerate": "accelerate",
        "accelerate-seedable": "+seedable sampler",
        "accelerate-seedable-epoch": "+set_epoch",
        "clusterflow": "clusterflow",
    }
    rows = (
        ("epoch 2: samples trained twice", "twice"),
        ("epoch 2: samples never trained", "never"),
        ("batches after the resume in the uninterrupted order", "order"),
        ("final weights bitwise the uninterrupted run's", "weights"),
    )
    print(f"{'':52}" + "".join(f"{names[w]:>19}" for w in ways))
    for label, key in rows:
        cells = [results[w][key] for w in ways]
        shown = ["yes" if c is True else "no" if c is False else str(c) for c in cells]
        print(f"{label:52}" + "".join(f"{c:>19}" for c in shown))
    print(
        "trained twice / never in the interrupted epoch: "
        + ", ".join(f"{names[w]} {results[w]['twice']}/{results[w]['never']}" for w in ways)
    )


if __name__ == "__main__":
    main()
