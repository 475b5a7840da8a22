"""``python -m clusterflow.cancel``: cancel a run or every unfinished member of a sweep, for good.

The command lives in ``clusterflow.manage.cancel``; this module only makes it runnable with ``-m``.
"""

import sys

from clusterflow.manage.cancel import main

if __name__ == "__main__":
    sys.exit(main())
