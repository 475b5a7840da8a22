"""Who this process is, the process group, and how data and state travel between ranks.

- ``env.py``: :class:`DistEnv` from the environment (Slurm, torchrun, submitit, one process),
  Slurm nodelists, ports (no torch);
- ``comm.py``: the process group and every collective, with single-process defaults;
- ``groups.py``: groups with their own timeout (:class:`Subgroup`) and the one-step-late
  maximum (:class:`AsyncMax`) behind the stop agreement;
- ``tree.py``: a nested state taken apart into a skeleton and its tensors (broadcasts, snapshots);
- ``sampler.py``: which rank trains and embeds which samples.

``from clusterflow import dist`` then ``dist.rank()``, ``dist.broadcast_object(...)``: the names
below are the package's public face.
"""

from clusterflow.dist.comm import (
    all_gather_rows,
    all_gather_tensors,
    all_reduce_dict,
    all_reduce_sum,
    all_reduce_tensor,
    any_rank,
    barrier,
    batch_rows,
    broadcast_object,
    broadcast_state,
    broadcast_tensor,
    collective_device,
    device_for,
    exchange,
    gather_object,
    gather_rows,
    init,
    init_alone,
    initialized,
    is_main,
    pick_backend,
    rank,
    ring_pass,
    rows_of_ranks,
    scatter_object,
    shutdown,
    wait_all,
    waited_s,
    world,
)
from clusterflow.dist.env import DistEnv, derive_port, free_port, parse_nodelist
from clusterflow.dist.groups import AsyncMax, Subgroup

__all__ = [
    "AsyncMax",
    "DistEnv",
    "Subgroup",
    "all_gather_rows",
    "all_gather_tensors",
    "all_reduce_dict",
    "all_reduce_sum",
    "all_reduce_tensor",
    "any_rank",
    "barrier",
    "batch_rows",
    "broadcast_object",
    "broadcast_state",
    "broadcast_tensor",
    "collective_device",
    "derive_port",
    "device_for",
    "exchange",
    "free_port",
    "gather_object",
    "gather_rows",
    "init",
    "initialized",
    "is_main",
    "parse_nodelist",
    "pick_backend",
    "rank",
    "ring_pass",
    "rows_of_ranks",
    "scatter_object",
    "shutdown",
    "wait_all",
    "waited_s",
    "world",
]
