"""Who this process is, the process group, and how data and state travel between ranks.

- ``env.py``: :class:`DistEnv` from the environment (Slurm, torchrun, submitit, one process),
  Slurm nodelists, ports; no torch, so login-side code (the local launcher) uses it;
- ``comm.py``: the process group and every collective, with single-process defaults (torch);
- ``groups.py``: groups with their own timeout (:class:`Subgroup`) and the one-step-late
  maximum (:class:`AsyncMax`) behind the stop agreement (torch);
- ``tree.py``: a nested state taken apart into a skeleton and its tensors (broadcasts, snapshots);
- ``sampler.py``: which rank trains and embeds which samples (torch).

This package re-exports only the torch-free names of ``env.py`` (``DistEnv``, ``derive_port``,
``free_port``, ``parse_nodelist``): importing ``clusterflow.distributed`` or any of its modules
must not load torch on a login node. Code that runs in the job imports the module it needs:
``from clusterflow.distributed import comm`` then ``comm.rank()``, ``comm.broadcast_object(...)``.
"""

from clusterflow.distributed.env import DistEnv, derive_port, free_port, parse_nodelist

__all__ = ["DistEnv", "derive_port", "free_port", "parse_nodelist"]
