"""Checkpoint benchmark: the store's save and load cost against plain torch.save/torch.load of the
same state to the same filesystem; the training loop's stall per background save against a
synchronous torch.save + fsync; restore with 2 ranks (one reader + broadcast) against every rank
loading the file itself; and the time from a signal to the job exiting with a committed checkpoint.

    python benchmarks/checkpoint.py                 # 25M parameters + AdamW state, in ./bench-ckpt
    python benchmarks/checkpoint.py --params 100e6 --dir /shared/scratch/bench
    python benchmarks/checkpoint.py --skip-signal   # no signal-to-exit run
    python benchmarks/checkpoint.py --only stall,restore --params 16.8e6   # the parts of issue 14

Save and load are measured interleaved, repeat by repeat, in one run; the printed ratios are the
claim. Two baselines for saving: torch.save alone (the data may still sit in the page cache when it
returns) and torch.save followed by fsync (as durable as the store, which fsyncs every file, the
manifest and the folder); both sides keep the newest two copies on disk, as the store does with
``keep_last=2``, and every timed operation starts with ``os.sync()``. Loading is warm-cache for both
sides, so the ratio shows the store's own work (reading into memory, the digest check, weights_only
unpickling).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import torch

from clusterflow.distributed import free_port
from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH


def make_state(params: int) -> tuple[dict, dict]:
    """A model of about `params` parameters and an AdamW state after one step (2 moments each)."""
    width = 4096
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model.state_dict(), {"optimizer": opt.state_dict(), "epoch": 1, "global_step": 100}


def plain_save(root: str, model_sd: dict, train_state: dict, fsync: bool) -> None:
    os.makedirs(root, exist_ok=True)
    for name, obj in (("model.pt", model_sd), ("train_state.pt", train_state)):
        path = os.path.join(root, name)
        with open(path, "wb") as f:
            torch.save(obj, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def plain_load(root: str) -> None:
    for name in ("model.pt", "train_state.pt"):
        torch.load(os.path.join(root, name), map_location="cpu", weights_only=True)


def store_save(store: CheckpointStore, step: int, model_sd: dict, train_state: dict) -> None:
    store.save(
        step, {"model.pt": model_sd, "train_state.pt": train_state}, {"epoch": 1}
    )  # as the trainer does


def store_load(store: CheckpointStore) -> None:
    ck = store.latest()
    ck.load("model.pt")
    ck.load("train_state.pt")


def timed(fn, *args) -> float:
    # Start every measurement with no dirty pages left by the previous one: otherwise whoever runs
    # second pays for the first one's writeback, and the ratios measure the order, not the code.
    os.sync()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench_save_load(root: str, params: int, repeats: int) -> dict:
    model_sd, train_state = make_state(params)
    nbytes = sum(t.numel() * t.element_size() for t in model_sd.values())
    nbytes += sum(
        t.numel() * t.element_size()
        for s in train_state["optimizer"]["state"].values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    store = CheckpointStore(os.path.join(root, "store"), keep_last=2, codec=TORCH)
    times: dict[str, list[float]] = {
        k: [] for k in ("torch.save", "torch.save+fsync", "store.save", "torch.load", "store.load")
    }

    def plain(kind: str, r: int) -> str:
        return os.path.join(root, f"{kind}-{r}")

    # Both sides keep the newest 2 copies, like the store's keep_last=2, so both write to freshly
    # allocated blocks as often (on thin-provisioned disks a first write to a block is slow).
    for r in range(-1, repeats):  # r = -1: an untimed warm-up round
        record = r >= 0
        for kind, fsync in (("nofsync", False), ("fsync", True)):
            t = timed(plain_save, plain(kind, r), model_sd, train_state, fsync)
            shutil.rmtree(plain(kind, r - 2), ignore_errors=True)
            if record:
                times["torch.save+fsync" if fsync else "torch.save"].append(t)
        t = timed(store_save, store, r + 1, model_sd, train_state)
        if record:
            times["store.save"].append(t)
            times["torch.load"].append(timed(plain_load, plain("fsync", r)))
            times["store.load"].append(timed(store_load, store))
    nparams = sum(t.numel() for t in model_sd.values())
    print(
        f"\nsave/load, {nparams / 1e6:.1f}M parameters + AdamW state = {nbytes / 2**20:.0f} MiB, "
        f"{repeats} repeats, in {root}"
    )
    print(f"  {'':18s} {'median':>8s} {'best':>8s}")
    for k, v in times.items():
        print(
            f"  {k:18s} {statistics.median(v):7.3f}s {min(v):7.3f}s  "
            f"({nbytes / 2**20 / statistics.median(v):6.0f} MiB/s median)"
        )
    for label, a, b in (
        ("save, store / torch.save+fsync (same durability)", "store.save", "torch.save+fsync"),
        ("save, store / torch.save (no fsync)", "store.save", "torch.save"),
        ("load, store (digest verified) / torch.load", "store.load", "torch.load"),
    ):
        print(
            f"  ratio {label:50s} median "
            f"{statistics.median(times[a]) / statistics.median(times[b]):.2f}x, best "
            f"{min(times[a]) / min(times[b]):.2f}x"
        )
    return times


def bench_stall(root: str, params: int, repeats: int, batch: int) -> dict:
    """The training loop's stall per background save (``checkpoint.async``): the time the save call
    blocks plus the time the next optimizer step waits for the snapshot, against a synchronous
    torch.save + fsync of the same state, interleaved. On a CPU machine the snapshot is a memory
    copy that runs beside the next forward/backward; the loop's slowdown while the writer works (the
    cores it takes) is printed too."""
    from clusterflow import config, rundir
    from clusterflow.checkpoint.checkpointer import STEP, Checkpointer
    from clusterflow.checkpoint.train_state import TrainState
    from clusterflow.observe.context import JobContext

    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width) for _ in range(max(1, round(params / width**2)))]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    progress, x = TrainState(), torch.randn(batch, width)

    def step() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        progress.step_done()
        return time.perf_counter() - t0

    step()
    cfg = config.load(
        None, [f"run.dir={root}/stall-run", "checkpoint.every_steps=1", "checkpoint.keep_last=2"]
    )
    ck = Checkpointer(
        JobContext(cfg, rundir.RunPaths(cfg.run.dir)),
        model,
        {"optimizer": opt, "train": progress},
        progress,
        steps_per_epoch=10**9,
    )
    keys = (
        "torch.save+fsync",
        "stall",
        "  at the save call",
        "  at the next optimizer step",
        "background write",
        "step, no write",
        "step, during a write",
        "back-to-back save",
    )
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(
        -1, repeats
    ):  # r = -1: untimed warm-up (the first save allocates the host buffers)
        t = timed(
            plain_save,
            os.path.join(root, f"stall-plain-{r}"),
            model.state_dict(),
            {"optimizer": opt.state_dict()},
            True,
        )
        shutil.rmtree(os.path.join(root, f"stall-plain-{r - 2}"), ignore_errors=True)
        alone = step()
        os.sync()
        t0 = time.perf_counter()
        ck.save(STEP)
        at_save = time.perf_counter() - t0
        ck.staging.gate_s = 0.0
        during = [step()]
        gate = ck.staging.gate_s
        while ck.writes.busy:
            during.append(step())
        write = ck.writes.wait().seconds
        step()
        t0 = time.perf_counter()
        ck.save(STEP)
        ck.save(STEP)  # due again at once: waits for the write in flight
        back_to_back = time.perf_counter() - t0
        ck.writes.wait()
        if r >= 0:
            for k, v in zip(
                keys,
                (
                    t,
                    at_save + gate,
                    at_save,
                    gate,
                    write,
                    alone,
                    statistics.mean(during[1:] or during),
                    back_to_back,
                ),
            ):
                times[k].append(v)
    ck.close()
    nbytes = (
        sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    )  # weights + 2 AdamW moments
    print(
        f"\nstall per save, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters + "
        f"AdamW state = {nbytes / 2**20:.0f} MiB, batch {batch}, {repeats} repeats, in {root}"
    )
    for k, v in times.items():
        print(f"  {k:30s} median {statistics.median(v):7.3f}s  best {min(v):7.3f}s")
    ratio = statistics.median(times["stall"]) / statistics.median(times["torch.save+fsync"])
    print(
        f"  ratio stall / torch.save+fsync (the loop blocked per save)   median {ratio:.3f}x, "
        f"best {min(times['stall']) / min(times['torch.save+fsync']):.3f}x  (goal <= 0.10x)"
    )
    return times


def _restore_rank(
    rank: int, world: int, port: int, root: str, mode: str, cold: bool, queue
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from clusterflow.distributed import DistEnv
    from clusterflow.distributed import comm as dist

    torch.set_num_threads(1)
    dist.init(DistEnv.from_env(os.environ), "gloo", 600)
    store = CheckpointStore(os.path.join(root, "store"), keep_last=2, codec=TORCH)
    if cold and rank == 0:
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    dist.barrier()
    t0 = time.perf_counter()
    if mode == "torch.load on every rank":
        plain_load(os.path.join(root, "plain-restore"))
    elif mode == "store.latest on every rank":
        store_load(store)
    else:  # what Checkpointer.restore does: rank 0 reads and verifies, the others receive
        ck = store.latest() if rank == 0 else None
        dist.broadcast_state(
            {"model.pt": ck.load("model.pt"), "train_state.pt": ck.load("train_state.pt")}
            if ck
            else None
        )
    seconds = time.perf_counter() - t0
    queue.put(seconds)
    dist.barrier()
    dist.shutdown()


def bench_restore(root: str, params: int, repeats: int, cold: bool) -> None:
    """Restore with 2 ranks: one reader that verifies + a broadcast, against every rank calling
    torch.load (unverified) or the store (verified: every rank reads and checks the files itself) on
    the same files."""
    import torch.multiprocessing as mp

    model_sd, train_state = make_state(params)
    plain_save(os.path.join(root, "plain-restore"), model_sd, train_state, True)
    store_save(
        CheckpointStore(os.path.join(root, "store"), keep_last=2, codec=TORCH),
        1,
        model_sd,
        train_state,
    )
    del model_sd, train_state
    ctx = mp.get_context("spawn")
    modes = ("torch.load on every rank", "store.latest on every rank", "one reader + broadcast")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(-1, repeats):
        for mode in modes:
            queue, port = ctx.Queue(), free_port()
            procs = [
                ctx.Process(target=_restore_rank, args=(k, 2, port, root, mode, cold, queue))
                for k in range(2)
            ]
            for p in procs:
                p.start()
            slowest = max(queue.get(timeout=600) for _ in procs)
            for p in procs:
                p.join()
            if r >= 0:
                times[mode].append(slowest)
    print(
        f"\nrestore with 2 ranks ({'cold' if cold else 'warm'} page cache), until the slowest rank "
        f"holds the state, {repeats} repeats"
    )
    for k, v in times.items():
        print(f"  {k:30s} median {statistics.median(v):7.3f}s  best {min(v):7.3f}s")
    base = statistics.median(times["torch.load on every rank"])
    print(
        "  ratio one reader + broadcast / torch.load on every rank: median "
        f"{statistics.median(times[modes[2]]) / base:.2f}x; files read: 1 time instead of 2 (one "
        "per rank)"
    )


def bench_signal(root: str, hidden: int, world: int) -> None:
    """Start a real `clusterflow.run` job with `world` local ranks, SIGTERM every rank in mid-epoch,
    and time signal -> every process exited, with the committed stop checkpoint checked."""
    run_dir = os.path.join(root, f"signal-h{hidden}")
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f"run.dir={run_dir}",
        "train.epochs=50",
        "train.progress_bar=false",
        "checkpoint.every_steps=1000",
        "mining.enabled=false",
        f"task.params.hidden={hidden}",
        "task.params.input_dim=256",
    ]
    port = free_port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=REPO,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "clusterflow.run", "configs/tiny.yaml", *overrides],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    status = os.path.join(run_dir, "status.json")
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with open(status) as f:
                if json.load(f).get("global_step", 0) >= 10:
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    else:
        for p in procs:
            p.kill()
        raise SystemExit(f"the job in {run_dir} did not reach step 10 in 300 s; see {run_dir}/logs")
    t0 = time.perf_counter()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=300) for p in procs]
    seconds = time.perf_counter() - t0
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"), codec=TORCH)
    ck = store.latest()
    with open(os.path.join(run_dir, "status.json")) as f:
        stopped_at = json.load(f)["global_step"]
    committed = ck is not None and ck.step == stopped_at
    save_s = [
        float(line.rsplit("(", 1)[1].split(" s)")[0])
        for line in open(os.path.join(run_dir, "logs", "rank0.attempt0.log"))
        if "committed at" in line and "in the background" not in line
    ]  # the stop's synchronous save
    size = sum(i["size"] for i in ck.manifest["files"].values()) if ck else 0
    print(
        f"\nsignal to exit, {world} ranks, hidden={hidden} ({size / 2**20:.1f} MiB checkpoint): "
        f"{seconds:.2f} s, exit codes {codes}, stop checkpoint step {ck.step if ck else None} "
        f"committed: {committed}, its save took {save_s[-1] if save_s else float('nan'):.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--params", type=float, default=25e6, help="model parameters (AdamW state doubles it again)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--dir",
        default="bench-ckpt",
        help="where to write (put it on the filesystem you care about)",
    )
    ap.add_argument("--world", type=int, default=2, help="ranks for the signal-to-exit measurement")
    ap.add_argument("--skip-signal", action="store_true")
    ap.add_argument(
        "--only", default="saveload,stall,restore,signal", help="comma-separated parts to run"
    )
    ap.add_argument(
        "--batch", type=int, default=64, help="rows per training step in the stall measurement"
    )
    ap.add_argument(
        "--cold", action="store_true", help="restore: drop the page cache first (root only)"
    )
    args = ap.parse_args()
    parts = set(args.only.split(","))
    root = tempfile.mkdtemp(
        prefix="ckpt-",
        dir=os.path.abspath(args.dir) if os.makedirs(args.dir, exist_ok=True) is None else None,
    )
    try:
        if "saveload" in parts:
            bench_save_load(root, int(args.params), args.repeats)
        if "stall" in parts:
            bench_stall(root, int(args.params), args.repeats, args.batch)
        if "restore" in parts:
            bench_restore(root, int(args.params), args.repeats, args.cold)
        if "signal" in parts and not args.skip_signal:
            for hidden in (64, 2048):
                bench_signal(root, hidden, args.world)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
