"""``python -m clusterflow.check``: does a script (or a task) resume exactly? It runs here N steps
uninterrupted, then killed between two checkpoints and resumed, and compares every step and the
final state (docs/own-loop.md#what-breaks-an-exact-resume).

The command lives in ``clusterflow.launch.check``, which imports no torch; the tensors are
compared by ``clusterflow.checkpoint.compare``, handed to it here.
"""

import sys

from clusterflow.checkpoint.compare import differences
from clusterflow.errors import cli
from clusterflow.launch import check


@cli
def main(argv: list[str] | None = None) -> int:
    return check.main(argv, differences)


if __name__ == "__main__":
    sys.exit(main())
