"""What every task of a job runs, whoever launched it (submitit, srun, torchrun, one process).

- ``job.py``: :class:`Job` (what submitit pickles) and :func:`run_job`: a task's trainer (or a
  script, ``script.path``) inside one attempt;
- ``attempt.py``: :class:`Attempt`, one attempt's life on a rank, for tasks and scripts alike:
  environment, rendezvous, run dir, the attempt's record, signals, watchdog, then what happens
  after the stop or a failure;
- ``script.py``: ``clusterflow.start()`` (the library API's entry) and a script of the user's own
  run as the job's program (``submit --script``, ``run --script``);
- ``requeue.py``: after a stop: requeue or not (a pure decision table) and its execution;
- ``failure.py``: what a failed job prints and records, and its exit status;
- ``run.py``: ``python -m clusterflow.run`` (inside an allocation), ``--script``, ``--check``;
- ``restarts.py``, ``node_fault.py``: the restart inside the allocation, a node's fault.
"""
