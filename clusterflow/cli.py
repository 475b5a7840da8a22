"""``clusterflow submit|run|status ...``: the console script, same as ``python -m clusterflow.<cmd>``."""

from __future__ import annotations

import sys

USAGE = """usage: clusterflow {submit,run,status} ...

  clusterflow submit CONFIG.yaml [KEY=VALUE ...] [--local] [--dry-run] [--wait]
  clusterflow run    CONFIG.yaml [KEY=VALUE ...]
  clusterflow status RUN_DIR [--json]

'clusterflow COMMAND --help' shows each command's options and examples.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "submit":
        from clusterflow.launch.submit import main as m
    elif cmd == "run":
        from clusterflow.job.run import main as m
    elif cmd == "status":
        from clusterflow.manage.status import main as m
    else:
        print(f"error: unknown command {cmd!r}; choose submit, run or status\n\n{USAGE}", file=sys.stderr)
        return 2
    return m(rest)


if __name__ == "__main__":
    sys.exit(main())
