"""Everything that talks to Slurm, and nothing else does (tests/test_slurm_owner.py checks it).

- ``commands.py``: the one way to run squeue, scontrol, sacct, scancel and sinfo (with timeouts,
  never raising), one function per question: is a job queued, its JobState, requeue, cancel,
  the partitions, wait until a job has left the queue;
- ``sbatch.py``: a config's sbatch parameters, the script submitit renders (``--dry-run``), and
  the submission of one job or one job array through submitit's SlurmExecutor;
- ``outcome.py``: why Slurm ended a job (sacct, else scontrol) and which task srun saw fail
  first; the parsers are pure;
- ``jobids.py``: the id that requeues one job or array task alone; what a job id looks like.

Below the run directory in the layers: which job holds a run dir is
``clusterflow.rundir.submissions``. Login-node modules: no torch.
"""
