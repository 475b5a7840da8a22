"""``python -m clusterflow.submit``: on the login node, submit a run, a sweep or a stage (to
Slurm, or ``--local``).

The command lives in ``clusterflow.launch.submit``; this module only makes it runnable with ``-m``.
"""

import sys

from clusterflow.launch.submit import main

if __name__ == "__main__":
    sys.exit(main())
