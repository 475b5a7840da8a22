"""Two `submit --local` of one run dir a moment apart, and a lease that cannot be taken over: the
submission that loses says so in one line naming the holder or the file (exit 2) and writes
nothing into the holder's run dir."""

import os
import subprocess
import sys
import time

import pytest
from clihelp import one_error_line
from conftest import REPO

TINY = ["configs/tiny.yaml", "cluster.tasks_per_node=1"]


def submit(run_dir, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.pop("CLUSTERFLOW_LAUNCHER_LEASE", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clusterflow.submit",
            *TINY,
            f"run.dir={run_dir}",
            *extra,
            "--local",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def tree(root):
    out = {}
    for base, _, names in os.walk(root):
        for n in names:
            p = os.path.join(base, n)
            out[os.path.relpath(p, root)] = os.stat(p).st_mtime_ns
    return out


@pytest.mark.parametrize("apart_s", [0.1, 1.2])
def test_two_submissions_a_moment_apart_one_is_refused_in_one_line(tmp_path, apart_s):
    run_dir = tmp_path / "run"
    first = submit(run_dir)
    time.sleep(apart_s)
    second = submit(run_dir, "train.lr=0.001")  # a different config: never replaces the first's
    results = [(p.wait(timeout=600), *p.communicate()) for p in (first, second)]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    _code, out, err = next(r for r in results if r[0] == 2)
    line = one_error_line(err)
    assert "is held by submit --local job" in line or "is held by" in line, line
    assert "resuming" not in out and "replaced" not in err and "see the logs" not in err, (out, err)
    # The winner's run is whole and its own.
    winner_out = next(r for r in results if r[0] == 0)[1]
    assert "completed" in winner_out
    assert os.path.exists(run_dir / "model.pt")


def test_a_lease_that_is_a_directory_is_named_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "lease" / "gen-1.json")
    before = tree(run_dir)
    p = submit(run_dir)
    code = p.wait(timeout=600)
    out, err = p.communicate()
    assert code == 2, out + err
    line = one_error_line(err)
    assert str(run_dir / "lease" / "gen-1.json") in line and "directory" in line, line
    assert "taking it over" not in err and "see the logs" not in err, err
    assert tree(run_dir) == before and sorted(os.listdir(run_dir)) == ["lease"]


def test_an_immutable_lease_is_named_in_one_line(tmp_path):
    """The lease of a process that is gone, but a file that cannot be removed (chattr +i)."""
    import json
    import socket

    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "lease")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = run_dir / "lease" / "gen-1.json"
    path.write_text(
        json.dumps(
            {"token": "t", "job_id": "x", "source": "single", "host": socket.gethostname()}
            | {"pid": gone.pid, "pid_start": "1", "attempt": 0, "started_at": 0, "renew_s": 30}
        )
    )
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        before = tree(run_dir)
        p = submit(run_dir)
        code = p.wait(timeout=600)
        out, err = p.communicate()
        assert code == 2, out + err
        line = one_error_line(err)
        assert str(path) in line and "not removable" in line, line
        assert "taking it over" not in err and "see the logs" not in err, err
        assert tree(run_dir) == before
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
