"""``python -m clusterflow.logs``: a rank's log across attempts (-f follows requeues).

The command lives in ``clusterflow.manage.logs``; this module only makes it runnable with ``-m``.
"""

import sys

from clusterflow.manage.logs import main

if __name__ == "__main__":
    sys.exit(main())
