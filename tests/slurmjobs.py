"""Helpers for tests that run jobs on the real local Slurm cluster (tests/slurm/cluster.sh)."""

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import time

from conftest import REPO, run_cli

TESTS = os.path.join(REPO, "tests")
# Every resume proof runs this topology; the reference run uses the same one, so the thread
# counts (and hence float summation orders) match and model.pt can be compared bitwise.
TWO_NODES = ("cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.time_min=10")


def env():
    return {
        "PYTHONPATH": TESTS,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    }


def submit(run_dir, *overrides, wait=False):
    """`clusterflow.submit configs/tiny.yaml` on two nodes; returns (job id, CompletedProcess)."""
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={run_dir}",
        *TWO_NODES,
        *overrides,
        *(["--wait"] if wait else []),
        env=env(),
    )
    m = re.search(r"submitted job (\d+)", out.stdout)
    assert m, out.stdout + out.stderr
    return m.group(1), out


def status(run_dir):
    out = run_cli("clusterflow.status", run_dir, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def live_status(run_dir):
    """status.json as the job writes it (cheap enough to poll)."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def at_step(run_dir, step, attempt=0):
    """Attempt ``attempt`` is running and has reached ``step``."""
    s = live_status(run_dir)
    return (
        s.get("attempt") == attempt
        and (s.get("global_step") or 0) >= step
        and s.get("state") == "running"
    )


def read_jsonl(path):
    """A record file's lines, each one JSON object (a line that is not fails the test)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_until(what, predicate, timeout=240, job_id=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}"
        + (f"; queue: {queue(job_id)}" if job_id else "")
    )


def queue(job_id):
    return subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T %r"], check=False, capture_output=True, text=True
    ).stdout.strip()


def wait_gone(job_id, timeout=300):
    return wait_until(
        f"job {job_id} to leave the queue", lambda: not queue(job_id) and time.time(), timeout
    )


# Job states of a job that has ended for good (scontrol's words); a requeued job passes through
# none of them between its attempts.
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
)


def sbatch_wait(args, env, timeout=600):
    """``sbatch --wait ARGS`` (in REPO, with ``env``), the job's end seen within a second: sbatch's
    own --wait asks at 2, 10, 42, 74... s (its pause grows fourfold up to 32 s), up to half a
    minute late for each job. Returns a CompletedProcess: sbatch's output and, as ``sbatch
    --wait``, the job's exit code (1 when a signal ended it) through every requeue."""
    out = subprocess.run(
        ["sbatch", "--parsable", *args],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return out
    job = out.stdout.strip().split(";")[0]
    fields = wait_until(
        f"job {job} to end",
        lambda: (f := job_fields(job)).get("JobState") in ENDED and f,
        timeout=timeout,
        job_id=job,
    )
    code, signal = (int(x) for x in fields["ExitCode"].split(":"))
    out.returncode = 1 if signal else code
    return out


def job_fields(job_id):
    """``scontrol show job``'s fields of the job ({} while scontrol does not answer)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return {}
    return dict(w.split("=", 1) for w in out.stdout.split() if "=" in w)


def scmd(*args):
    out = subprocess.run(list(args), check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{args}: {out.stdout}{out.stderr}"
    return out.stdout.strip()


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def rank0_logs(run_dir):
    return "".join(
        open(p).read()
        for p in sorted(glob.glob(os.path.join(run_dir, "logs", "rank0.attempt*.log")))
    )
