"""No test outside the Slurm group reaches the live cluster (tests/conftest.py's guard): a real
pytest, with the suite's hooks, over probes that ask Slurm in every way a test can (the command
itself, clusterflow's wrapper, a child process), one that brings its own answer, and one on the
cluster. The live queue holds the Slurm tests' real jobs, whose ids meet the ids other tests make
up: a test that read it would pass or fail by how far the Slurm group had got."""

import os
import re
import subprocess
import sys

from conftest import REPO, SLURM_COMMANDS

SUITE_CONFTEST = os.path.join(REPO, "tests", "conftest.py")
CONFTEST = f"""
import importlib.util

import pytest

spec = importlib.util.spec_from_file_location("suite_conftest", {SUITE_CONFTEST!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
pytest_runtest_setup = suite.pytest_runtest_setup
pytest_runtest_call = suite.pytest_runtest_call
pytest_runtest_teardown = suite.pytest_runtest_teardown
"""
STAND_IN = """

@pytest.fixture(scope="session")
def cluster():
    return "a stand-in: the Slurm group is told by the fixture's name"
"""
REAL = """
cluster = suite.cluster
"""

PROBES = """
import os
import shutil
import subprocess
import sys

import pytest

from clusterflow.slurm import commands


def test_asks_squeue_itself():
    subprocess.run(["squeue", "-h", "-j", "79"], check=False, capture_output=True)


def test_asks_through_clusterflow():
    assert commands.queue_state("79") is None  # the guard answers as an unreachable controller


def test_a_child_process_asks():
    code = "import subprocess; subprocess.run(['sacct', '-j', '79'], capture_output=True)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_asks_in_a_fixture(asked_in_setup):
    pass


@pytest.fixture
def asked_in_setup():
    subprocess.run(["scontrol", "show", "job", "79"], check=False, capture_output=True)


def test_brings_its_own_answer(tmp_path, monkeypatch):
    (tmp_path / "squeue").write_text("#!/bin/sh\\necho 'RUNNING|None'\\n")
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert commands.queue_state("79") == "RUNNING|None"


def test_asks_nothing():
    assert 1 + 1 == 2


def test_on_the_cluster(cluster):
    for name in ("squeue", "sacct", "scontrol"):
        found = shutil.which(name)
        assert found is None or "slurm-guard" not in found, found
"""


def _probe(tmp_path, conftest, env=()):
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_probes.py").write_text(PROBES)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rs", "test_probes.py"],
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PATH": _unguarded_path(), **dict(env)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.stdout + out.stderr


def _unguarded_path():
    """PATH without this test's own guard (this test is outside the Slurm group too), so the probe
    run starts from what a worker starts from."""
    dirs = os.environ["PATH"].split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not os.path.basename(d).startswith("slurm-guard-"))


def _outcomes(text):
    """Test name -> PASSED, FAILED, ERROR or SKIPPED, from pytest's verbose lines."""
    lines = re.findall(r"^test_probes\.py::(\w+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.MULTILINE)
    return dict(lines)


def test_a_test_outside_the_slurm_group_cannot_reach_the_live_queue(tmp_path):
    text = _probe(tmp_path, CONFTEST + STAND_IN)
    got = _outcomes(text)
    assert got == {
        "test_asks_squeue_itself": "FAILED",
        "test_asks_through_clusterflow": "FAILED",
        "test_a_child_process_asks": "FAILED",
        "test_asks_in_a_fixture": "FAILED",
        "test_brings_its_own_answer": "PASSED",
        "test_asks_nothing": "PASSED",
        "test_on_the_cluster": "PASSED",
    }, text
    # each failure names the call it made, and what to do instead
    assert "called Slurm's commands: squeue -h -j 79" in text, text
    assert "called Slurm's commands: sacct -j 79" in text, text
    assert "called Slurm's commands: scontrol show job 79" in text, text
    assert "take the `cluster` fixture" in text, text


def test_every_slurm_client_command_is_guarded():
    """The guard covers each command clusterflow's slurm package may start."""
    slurm_pkg = os.path.join(REPO, "clusterflow", "slurm")
    started = set()
    for name in os.listdir(slurm_pkg):
        if name.endswith(".py"):
            with open(os.path.join(slurm_pkg, name)) as f:
                text = f.read()
            started |= set(re.findall(r'"(s(?:acct|batch|cancel|control|info|queue|run))"', text))
    assert started and started <= set(SLURM_COMMANDS), started - set(SLURM_COMMANDS)


def test_with_no_slurm_the_cluster_tests_skip(tmp_path):
    """CLUSTERFLOW_NO_SLURM=1 leaves the cluster down (tests/run.sh): its tests skip, saying
    why, rather than fail at the cluster fixture."""
    text = _probe(tmp_path, CONFTEST + REAL, env={"CLUSTERFLOW_NO_SLURM": "1"})
    assert _outcomes(text)["test_on_the_cluster"] == "SKIPPED", text
    assert "CLUSTERFLOW_NO_SLURM=1" in text, text
