"""``python -m clusterflow.status``: what a run or a sweep is doing.

The command lives in ``clusterflow.manage.status``; this module only makes it runnable with ``-m``.
"""

import sys

from clusterflow.manage.status import main

if __name__ == "__main__":
    sys.exit(main())
