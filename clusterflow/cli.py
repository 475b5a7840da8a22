"""``clusterflow submit|run|status|logs|cancel|export|goodput|dashboard|check ...``: the console
script, the same as ``python -m clusterflow.<command>``."""

from __future__ import annotations

import importlib
import sys

from clusterflow.errors import EXIT_BAD_INPUT, EXIT_OK, cli

# Each command's main, imported only when chosen: `status` on a login node never imports torch.
COMMANDS = {
    "submit": "clusterflow.launch.submit",
    "run": "clusterflow.job.run",
    "status": "clusterflow.manage.status",
    "logs": "clusterflow.manage.logs",
    "cancel": "clusterflow.manage.cancel",
    "export": "clusterflow.checkpoint.export",
    "goodput": "clusterflow.manage.goodput",
    "dashboard": "clusterflow.web.server",
    "check": "clusterflow.check",
}

USAGE = """usage: clusterflow {submit,run,status,logs,cancel,export,goodput,dashboard,check} ...

  clusterflow submit CONFIG.yaml [KEY=VALUE ...] [--local] [--dry-run] [--wait] [--sweep ...]
  clusterflow run    CONFIG.yaml [KEY=VALUE ...] [--check]
  clusterflow status RUN_DIR|SWEEP_DIR [--json] [--ranks]
  clusterflow logs   RUN_DIR [-f] [--rank R]
  clusterflow cancel RUN_DIR|SWEEP_DIR
  clusterflow export RUN_DIR OUT [--step N] [--format pt|safetensors] [--dtype bf16|fp32]
                    [--weights model|ema] [--force]
  clusterflow goodput RUN_DIR|SWEEP_DIR [--json] [--plot OUT.png]
  clusterflow dashboard PATH [PATH ...] [--host 127.0.0.1] [--port 0] [--root-path PREFIX]
                    [--token-file F]
  clusterflow dashboard --list
  clusterflow check  --script train.py [CONFIG.yaml] [KEY=VALUE ...] [--steps N] [-- ARGS]
  clusterflow check  CONFIG.yaml [KEY=VALUE ...] [--steps N]

'clusterflow COMMAND --help' shows each command's options and examples.
"""


@cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return EXIT_OK if argv else EXIT_BAD_INPUT
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        choices = ", ".join(COMMANDS)
        print(
            f"error: unknown command {cmd!r}; choose one of {choices}\n\n{USAGE}", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    return importlib.import_module(COMMANDS[cmd]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
