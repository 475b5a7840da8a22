import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd=REPO, env=None, timeout=600):
    """Run `python -m clusterflow.<...>` as a user would; returns CompletedProcess."""
    e = dict(os.environ)
    for k in list(e):
        if k.startswith(("SLURM_", "SUBMITIT_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
            del e[k]
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
