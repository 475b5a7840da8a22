"""What every task of a job runs, whoever launched it (submitit, srun, torchrun, one process).

- ``job.py``: :class:`Job` (what submitit pickles) and :func:`run_job`: environment, rendezvous,
  run dir, train, then what happens after the stop;
- ``requeue.py``: after a stop: requeue or not (a pure decision table) and its execution;
- ``failure.py``: what a failed job prints and records, and its exit status;
- ``run.py``: ``python -m clusterflow.run`` (inside an allocation), ``--check``.
"""
