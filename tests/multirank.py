"""Run a function on N real gloo processes (torch.multiprocessing), collecting each rank's
result."""

import os
import traceback

import torch.multiprocessing as mp

from clusterflow.dist import free_port


def _entry(rank, world, port, fn, args, queue, pg_timeout=120):
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        import torch

        from clusterflow import dist
        from clusterflow.dist import DistEnv

        torch.set_num_threads(1)
        dist.init(DistEnv.from_env(os.environ), "gloo", pg_timeout)
        queue.put((rank, "ok", fn(*args)))
        dist.shutdown()
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(world, fn, *args, timeout=300, pg_timeout=120):
    """``pg_timeout``: the process group's timeout (a rank waiting longer for another fails)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, pg_timeout))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
