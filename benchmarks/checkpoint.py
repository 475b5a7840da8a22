"""Checkpoint benchmark: the store's save and load cost against plain torch.save/torch.load of the
same state to the same filesystem, and the time from a signal to the job exiting with a committed
checkpoint.

    python benchmarks/checkpoint.py                      # 25M parameters + AdamW state, in ./bench-ckpt
    python benchmarks/checkpoint.py --params 100e6 --dir /shared/scratch/bench
    python benchmarks/checkpoint.py --skip-signal        # save/load only

Save and load are measured interleaved, repeat by repeat, in one run; the printed ratios are the
claim. Two baselines for saving: torch.save alone (the data may still sit in the page cache when it
returns) and torch.save followed by fsync (as durable as the store, which fsyncs every file, the
manifest and the folder); both sides keep the newest two copies on disk, as the store does with
``keep_last=2``, and every timed operation starts with ``os.sync()``. Loading is warm-cache for both sides, so the ratio shows the store's own
work (reading into memory, the sha256 check, weights_only unpickling).
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

import torch  # noqa: E402

from clusterflow.dist import free_port  # noqa: E402
from clusterflow.store import CheckpointStore  # noqa: E402


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
    store.save(step, {"model.pt": model_sd, "train_state.pt": train_state}, {"epoch": 1})  # as the trainer does


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
    nbytes += sum(t.numel() * t.element_size() for s in train_state["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t))
    store = CheckpointStore(os.path.join(root, "store"), keep_last=2)
    times: dict[str, list[float]] = {k: [] for k in ("torch.save", "torch.save+fsync", "store.save", "torch.load", "store.load")}

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
    print(f"\nsave/load, {nparams / 1e6:.1f}M parameters + AdamW state = {nbytes / 2**20:.0f} MiB, {repeats} repeats, in {root}")
    print(f"  {'':18s} {'median':>8s} {'best':>8s}")
    for k, v in times.items():
        print(f"  {k:18s} {statistics.median(v):7.3f}s {min(v):7.3f}s  ({nbytes / 2**20 / statistics.median(v):6.0f} MiB/s median)")
    for label, a, b in (("save, store / torch.save+fsync (same durability)", "store.save", "torch.save+fsync"),
                        ("save, store / torch.save (no fsync)", "store.save", "torch.save"),
                        ("load, store (sha256 verified) / torch.load", "store.load", "torch.load")):
        print(f"  ratio {label:50s} median {statistics.median(times[a]) / statistics.median(times[b]):.2f}x, "
              f"best {min(times[a]) / min(times[b]):.2f}x")
    return times


def bench_signal(root: str, hidden: int, world: int) -> None:
    """Start a real `clusterflow.run` job with `world` local ranks, SIGTERM every rank in mid-epoch,
    and time signal -> every process exited, with the committed stop checkpoint checked."""
    run_dir = os.path.join(root, f"signal-h{hidden}")
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"run.dir={run_dir}", "train.epochs=50", "train.progress_bar=false", "checkpoint.every_steps=1000",
                 "mining.enabled=false", f"task.params.hidden={hidden}", "task.params.input_dim=256"]
    port = free_port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=REPO)
        procs.append(subprocess.Popen([sys.executable, "-m", "clusterflow.run", "configs/tiny.yaml", *overrides], cwd=REPO,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
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
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"))
    ck = store.latest()
    with open(os.path.join(run_dir, "status.json")) as f:
        stopped_at = json.load(f)["global_step"]
    committed = ck is not None and ck.step == stopped_at
    save_s = [float(line.rsplit("(", 1)[1].split(" s)")[0]) for line in open(os.path.join(run_dir, "logs", "rank0.attempt0.log"))
              if "committed at" in line]
    size = sum(i["size"] for i in ck.manifest["files"].values()) if ck else 0
    print(f"\nsignal to exit, {world} ranks, hidden={hidden} ({size / 2**20:.1f} MiB checkpoint): {seconds:.2f} s, "
          f"exit codes {codes}, stop checkpoint step {ck.step if ck else None} committed: {committed}, "
          f"its save took {save_s[-1] if save_s else float('nan'):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=25e6, help="model parameters (AdamW state doubles it again)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="bench-ckpt", help="where to write (put it on the filesystem you care about)")
    ap.add_argument("--world", type=int, default=2, help="ranks for the signal-to-exit measurement")
    ap.add_argument("--skip-signal", action="store_true")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt-", dir=os.path.abspath(args.dir) if os.makedirs(args.dir, exist_ok=True) is None else None)
    try:
        bench_save_load(root, int(args.params), args.repeats)
        if not args.skip_signal:
            for hidden in (64, 2048):
                bench_signal(root, hidden, args.world)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
