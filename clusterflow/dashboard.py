"""``python -m clusterflow.dashboard PATH [PATH ...]``: see runs and sweeps live in the browser.

The command lives in ``clusterflow.web.server``; this module only makes it runnable with ``-m``.
"""

import sys

from clusterflow.web.server import main

if __name__ == "__main__":
    sys.exit(main())
