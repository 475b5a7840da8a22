"""train.parallel=fsdp against ddp, side by side, on real gloo ranks: per-rank bytes of
parameters + gradients + optimizer state (AdamW), the checkpoint write of the sharded parallel
save (every rank writes and hashes its shards, rank 0 commits) against rank 0 writing the same
full state with the store (today's ddp save), and the training step time.

    python benchmarks/sharded.py                    # 50M parameters, 2 and 4 ranks, ./bench-sharded
    python benchmarks/sharded.py --params 10e6 --worlds 2 --dir /shared/scratch/bench

The model is a stack of square Linear layers (the default shard units: one per layer). Writes are
synchronous on both sides and fsynced; every timed write starts after ``os.sync()``; each is
repeated and the median printed. The ratios are the claim, not the absolute times (a shared
2-core machine here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from clusterflow.checkpoint.sharded import ShardedState
from clusterflow.distributed import comm as dist
from clusterflow.distributed import free_port
from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH
from clusterflow.train import parallel


def build(params: float, width: int) -> torch.nn.Module:
    depth = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in parallel.local(ts) if t is not None)

    return {
        "params": nbytes(model.parameters()),
        "grads": nbytes(p.grad for p in model.parameters()),
        "optimizer": nbytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0),
    }


def step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()


def rank_main(rank, world, port, mode, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = build(args.params, args.width)
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "fsdp":
        model = parallel.wrap_fsdp(
            model, parallel.default_units(model), torch.device("cpu"), world, None
        )
        ddp = model
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    step(ddp, opt, x)  # warm-up; creates the optimizer state
    out = {"n_params": n_params, "bytes": local_bytes(model, opt)}
    opt.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.steps):
        tdist.barrier()
        t0 = time.perf_counter()
        step(ddp, opt, x)
        opt.zero_grad(set_to_none=True)
        tdist.barrier()
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    if args.write:
        out["write_s"] = write_times(model, opt, mode, world, args)
    if rank == 0:
        queue.put(out)
    tdist.barrier()
    tdist.destroy_process_group()


def write_times(model, opt, mode, world, args) -> float:
    root = os.path.join(args.dir, f"{mode}-{world}")
    store = CheckpointStore(root, keep_last=2, codec=TORCH)
    times = []
    for step_no in range(1, args.repeats + 1):
        if dist.rank() == 0:
            os.sync()
        tdist.barrier()
        t0 = time.perf_counter()
        if mode == "fsdp":
            sharded = ShardedState(model, {"optimizer": opt})
            folder = dist.broadcast_object(store.begin(step_no, {}) if dist.rank() == 0 else None)
            listed = sharded.write(folder, fsync=True)
            parts = dist.gather_object(listed)
            if dist.rank() == 0:
                files = {k: v for p in parts for k, v in p.items()}
                store.commit(folder, step_no, {"train_state.pt": {"step": step_no}}, files, {})
        elif dist.rank() == 0:
            store.save(
                step_no,
                {"model.pt": model.state_dict(), "train_state.pt": {"optimizer": opt.state_dict()}},
                {},
            )
        tdist.barrier()
        times.append(time.perf_counter() - t0)
    store.wait_for_pruning()
    return statistics.median(times)


def measure(mode: str, world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, mode, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join()
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--dir", default="bench-sharded")
    p.add_argument("--skip-write", dest="write", action="store_false")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = {}
    for world in [int(w) for w in args.worlds.split(",")]:
        for mode in ("ddp", "fsdp"):
            rows[(mode, world)] = r = measure(mode, world, args)
            print(json.dumps({"mode": mode, "world": world, **r}), flush=True)
    n = next(iter(rows.values()))["n_params"]
    print(f"\n{n / 1e6:.1f}M parameters, AdamW, fp32, gloo on CPU")
    print(
        "world | per-rank params+grads+optimizer ddp | fsdp | fsdp/ddp | step ddp | fsdp | "
        "fsdp/ddp" + (" | write rank 0 (ddp) | sharded (fsdp) | ddp/fsdp" if args.write else "")
    )
    for world in sorted({w for _, w in rows}):
        d, f = rows[("ddp", world)], rows[("fsdp", world)]
        bd, bf = sum(d["bytes"].values()), sum(f["bytes"].values())
        line = (
            f"{world} | {mib(bd)} | {mib(bf)} | {bf / bd:.3f} | {d['step_s']:.3f} s | "
            f"{f['step_s']:.3f} s | {f['step_s'] / d['step_s']:.2f}"
        )
        if args.write:
            line += (
                f" | {d['write_s']:.2f} s | {f['write_s']:.2f} s | "
                f"{d['write_s'] / f['write_s']:.2f}"
            )
        print(line)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
