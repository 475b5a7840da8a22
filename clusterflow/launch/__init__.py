"""Launching from the login node (no torch is imported here until a job is handed to submitit).

- ``submit.py``: ``clusterflow submit``: config, run dir, code snapshot, then Slurm or ``--local``;
  ``--dry-run``, ``--wait``;
- ``local.py``: ``--local``: submitit's local executor on this machine, rank 0's log echoed, the
  job ended at once when a rank process dies;
- ``sweep.py``: ``--sweep``: every member validated, the sweep index merged, one job array;
- ``stages.py``: ``--after RUN_DIR``: the ``afterok`` dependency on earlier runs;
- ``gpus.py``: the free GPUs ``--local`` uses (a pure function over an NVML snapshot);
- ``jobs.py``: the callable submitit pickles for a config.
"""
