"""``python -m clusterflow.export RUN_DIR OUT``: a committed checkpoint (sharded or not) as one
file (``.pt`` or safetensors).

The command lives in ``clusterflow.checkpoint.export``; this module only makes it runnable with
``-m``.
"""

import sys

from clusterflow.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
