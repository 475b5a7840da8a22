"""``python -m clusterflow.run``: inside an allocation, run this process's share of the job (srun,
torchrun, one process).

The command lives in ``clusterflow.job.run``; this module only makes it runnable with ``-m``.
"""

from clusterflow.job.run import entry

if __name__ == "__main__":
    entry()
