"""A small training-like loop that stalls on purpose, for the watchdog tests (run as a subprocess).

    python tests/stall_program.py RUN_DIR MODE STALL_S

MODE: ``stall`` (sleeps forever in sleeping_in_loss at step 5), ``mining-wait`` (a wait longer than
STALL_S inside the mining-wait allowance, then finishes), ``ranks`` (RANK/WORLD_SIZE/MASTER_* set:
gloo all_reduce every step; rank 1 sleeps in sleeping_in_loss at step 3 while rank 0 waits in the
all_reduce), ``embed`` (as ranks, but rank 1 hangs in embedding_batch during the mining embed
phase), ``agree`` (the stop agreement's all-reduce, started at one step and read at the next, on a
gloo side group: rank 1 beats once more a second after rank 0's last beat and then sleeps in
sleeping_in_loss at step 3 without starting its reduce; rank 0 waits for it in
``AsyncMax.finish``, and its stall clock started first), ``frozen`` (as ranks, but rank 1
stops itself with SIGSTOP at step 3, its heartbeat thread with it; rank 0's watchdog reads the
heartbeats and names rank 1; its victim's grace is ten minutes, so only that reading ends it).
"""

import os
import signal
import socket
import sys
import time

from clusterflow import rundir
from clusterflow.observe.heartbeat import Heartbeat, quiet_after, quietest, read_ranks
from clusterflow.observe.watchdog import (
    PeerWatch,
    StallLimits,
    Watchdog,
    dump_flight_recorder,
    flight_recorder_env,
)
from clusterflow.rundir import first_error


def sleeping_in_loss():
    time.sleep(3600)


def embedding_batch():
    time.sleep(3600)


def single(run_dir, mode, hb):
    for step in range(1, 6):
        hb.beat(step, "train")
        time.sleep(0.05)
    if mode == "stall":
        sleeping_in_loss()
    hb.beat(5, "mining wait")
    time.sleep(float(sys.argv[3]) * 3)
    hb.beat(6, "train")


def ranks(run_dir, mode, hb, rank):
    import torch
    import torch.distributed as dist

    os.environ.update(
        flight_recorder_env(rundir.RunPaths(run_dir), 0, os.environ)
    )  # after importing torch, before the group
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    if mode == "agree":
        agree(hb, rank)
        return
    t = torch.ones(8)
    for step in range(1, 6):
        if mode == "embed" and step == 3:
            hb.beat(step - 1, "mining embed")  # the embedding loop beats once per batch
        if rank == 1 and step == 3 and mode == "frozen":
            # A heartbeat on record first, as a rank that trained a while has (on a loaded machine
            # the writer thread may not have written one yet): the frozen rank is named by it.
            hb.write()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif rank == 1 and step == 3:
            sleeping_in_loss() if mode == "ranks" else embedding_batch()
        dist.all_reduce(t)
        hb.beat(step, "mining embed" if mode == "embed" and step >= 3 else "train")


def agree(hb, rank):
    from clusterflow.distributed.groups import AsyncMax

    stop = AsyncMax(timeout_s=120)
    for step in range(1, 6):
        stop.finish()
        hb.beat(step, "train")
        if rank == 1 and step == 3:
            time.sleep(1.0)
            hb.beat(step, "train")
            sleeping_in_loss()
        stop.start(0)


def main():
    run_dir, mode, stall_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rank = int(os.environ.get("RANK", "0"))
    paths = rundir.RunPaths(run_dir)
    hb = Heartbeat(paths, rank, every_s=0.2)
    log_file = os.path.join(run_dir, "logs", f"rank{rank}.attempt0.log")
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    started, world = time.time(), int(os.environ.get("WORLD_SIZE", "1"))

    def silent():  # as observe/observer.py reads them for rank 0
        beats = read_ranks(paths, 0.2, since=started, world_size=world)
        return quietest(beats, time.time(), quiet_after(0.2, stall_s), rank, started)

    wd = Watchdog(
        hb.progress,
        paths,
        rank,
        StallLimits(
            stall_s,
            allowances={"mining wait": stall_s * 10},
            victim_grace_s=600 if mode == "frozen" else stall_s * 2,
        ),
        log_file=log_file,
        peers=PeerWatch(silent, every_s=0.2) if mode == "frozen" else None,
    )
    try:
        with wd:
            if mode in ("stall", "mining-wait"):
                single(run_dir, mode, hb)
            else:
                ranks(run_dir, mode, hb, rank)
    # What job/job.py does with a failed collective: record it, dump, fail the rank.
    except Exception as exc:  # noqa: BLE001
        won = first_error.record(
            rundir.RunPaths(run_dir),
            0,
            rank,
            f"{type(exc).__name__}: {exc}",
            host=socket.gethostname(),
        )
        dump_flight_recorder(
            rundir.RunPaths(run_dir).stalls(0), rank
        )  # so the ranks' recorders can be compared
        print(f"rank {rank} collective failed; first cause recorded: {won}", flush=True)
        sys.exit(1)
    hb.close()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
