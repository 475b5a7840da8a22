"""What a job imports before its first step: only what the first step needs. scipy's sparse
graphs (about 0.4 s of imports per rank) are the mining round's, imported where it uses them."""

import subprocess
import sys

from conftest import REPO


def test_the_job_side_imports_no_scipy_before_mining():
    code = (
        "import sys, clusterflow.job.run, clusterflow.tasks.pseudo_id; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout[:300]
