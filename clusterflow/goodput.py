"""``python -m clusterflow.goodput``: where every allocated second of a run went.

The command lives in ``clusterflow.manage.goodput``; this module only makes it runnable with
``-m``.
"""

import sys

from clusterflow.manage.goodput import main

if __name__ == "__main__":
    sys.exit(main())
