"""Looking after runs from the login node: what they do, their logs, cancelling them.

- ``status.py``: ``clusterflow status``: collects what the run dir, Slurm and the processes show;
- ``verdict.py``: the one rule for the ``state`` and ``error`` that status shows (pure,
  table-tested);
- ``liveness.py``: whether a run that claims to run still has a live process;
- ``ranks.py``: every rank's heartbeat (``--ranks``) and Slurm's account of a job that ended;
- ``sweep_status.py``: one row per member of a sweep;
- ``logs.py``: ``clusterflow logs``: a rank's log across attempts, ``-f`` following requeues;
- ``cancel.py``: ``clusterflow cancel``: the marker first, then scancel.
"""
