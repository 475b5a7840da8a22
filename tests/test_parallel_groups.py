"""The suite's parallel groups hold as pytest-xdist runs them: tests/run.sh's options and
tests/conftest.py's grouping, run by a real pytest with three workers over a file of probes. A
pytest or pytest-xdist that ignores the groups would run the Slurm cluster's tests at once in
several workers (preempting and queueing behind each other) and build a shared run twice; the
Slurm group's `cpu_bound` tests run at its end."""

import collections
import os
import subprocess
import sys

from conftest import REPO

SUITE_CONFTEST = os.path.join(REPO, "tests", "conftest.py")
CONFTEST = f"""
import importlib.util

import pytest

spec = importlib.util.spec_from_file_location("suite_conftest", {SUITE_CONFTEST!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems


@pytest.fixture(scope="session")
def cluster():
    return "a stand-in: the grouping looks at the fixture's name"


@pytest.fixture(scope="module")
def shared_run():
    return "read by several tests"
"""

PROBES = """
import os
import time

import pytest


def probe(kind):
    time.sleep(0.3)
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(f"{kind} {os.environ['PYTEST_XDIST_WORKER']}\\n")


@pytest.mark.cpu_bound
def test_on_the_cluster_heavy(cluster):
    probe("cluster-last")


@pytest.mark.parametrize("i", range(4))
def test_on_the_cluster(cluster, i):
    probe("cluster")


@pytest.mark.parametrize("i", range(3))
def test_reading_the_shared_run(shared_run, i):
    probe("shared")


@pytest.mark.parametrize("i", range(6))
def test_on_its_own(i):
    probe("alone")
"""


def _run_options():
    """The pytest options tests/run.sh passes for a parallel run (its last line)."""
    with open(os.path.join(REPO, "tests", "run.sh")) as f:
        last = [line for line in f if line.startswith("exec python -m pytest")][-1]
    words = last.split()
    return [w for w in words[words.index("-n") + 2 :] if w != '"$@"']


def test_groups_stay_in_one_worker_and_the_rest_spread(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_probes.py").write_text(PROBES)
    log = tmp_path / "probes.log"
    options = _run_options()
    assert "--dist" in options, options
    env = {**os.environ, "PROBE_LOG": str(log)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", *options],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    workers = collections.defaultdict(set)
    lines = [line.split() for line in log.read_text().splitlines()]
    for kind, worker in lines:
        workers[kind.removesuffix("-last")].add(worker)
    assert len(workers["cluster"]) == 1, workers  # the Slurm group: one worker, in turn
    # ... a cpu_bound test of it last, although its file puts it first
    assert [kind for kind, _ in lines if kind.startswith("cluster")][-1] == "cluster-last", lines
    assert len(workers["shared"]) == 1, workers  # a shared module fixture: built once
    assert len(set().union(*workers.values())) > 1, workers  # and yet in parallel
