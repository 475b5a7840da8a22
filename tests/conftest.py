import contextlib
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite runs in parallel (pytest-xdist, `--dist loadgroup`: tests/run.sh), in groups that one
# worker runs in order: every test of the one local Slurm cluster is in SLURM_GROUP (its jobs
# would otherwise queue behind or preempt each other); tests that share a module- or
# session-scoped fixture (a run they only read) are grouped by it, so it is built once; every
# other test is a group of its own. Groups are handed out longest first: the Slurm group, then
# those with a slow test, then the rest in file order.
SLURM_GROUP = "slurm-cluster"
_SHARED_SCOPES = ("module", "package", "session")
# Session fixtures that are cheap or that every worker may build for itself.
_PER_WORKER = {"cluster", "tmp_path_factory", "worker_id", "testrun_uid"}


def _group(item):
    if item.get_closest_marker("slurm"):
        return SLURM_GROUP
    shared = sorted(
        name
        for name, defs in item._fixtureinfo.name2fixturedefs.items()
        if defs and defs[-1].scope in _SHARED_SCOPES and name not in _PER_WORKER
    )
    if not shared:
        return item.nodeid
    scopes = {item._fixtureinfo.name2fixturedefs[n][-1].scope for n in shared}
    where = "" if scopes == {"session"} else item.module.__name__ + ":"
    return where + ",".join(shared)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cluster" in item.fixturenames:
            item.add_marker(pytest.mark.slurm)
    groups = {item.nodeid: _group(item) for item in items}
    slow = {groups[item.nodeid] for item in items if item.get_closest_marker("slow")}

    def rank(item):
        group = groups[item.nodeid]
        return 0 if group == SLURM_GROUP else 1 if group in slow else 2

    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    items.sort(key=rank)  # stable: file order within each rank


def run_cli(*args, cwd=REPO, env=None, timeout=600):
    """Run `python -m clusterflow.<...>` as a user would; returns CompletedProcess."""
    e = dict(os.environ)
    for k in list(e):
        if k.startswith(("SLURM_", "SUBMITIT_")) or k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_PORT",
            "MASTER_ADDR",
        ):
            del e[k]
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", *args],
        check=False,
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def tmpfs(path, options):
    """A real tmpfs mounted at ``path`` (``options``: "size=8m", "ro,size=1m"), unmounted after;
    skips the test where mounting needs root it does not have (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def weights_equal(path, reference):
    """Whether two model.pt files hold the same names with bitwise-equal tensors. Weights are
    compared with a reference trained on this machine, never with a written-down digest: another
    CPU gives other last bits for the same config."""
    import torch

    a, b = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def cli():
    return run_cli


def write_status_record(run_dir, **fields):
    """A status.json as a job left it (a fixture record: any state, any fields, as another
    version or a hand could have written it); the package itself writes it only through
    clusterflow/rundir/transitions.py."""
    import json

    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "status.json"), "w") as f:
        json.dump(fields, f, indent=1, sort_keys=True)


@pytest.fixture(scope="session")
def tiny_one_process_model(tmp_path_factory):
    """model.pt of an uninterrupted one-process run of configs/tiny.yaml on this machine: what
    every one-process resume of that config must reproduce bitwise."""
    d = str(tmp_path_factory.mktemp("tiny-one-process") / "run")
    out = run_cli(
        "clusterflow.run", "configs/tiny.yaml", f"run.dir={d}", "cluster.tasks_per_node=1"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return os.path.join(d, "model.pt")


@pytest.fixture(scope="session")
def tiny_two_rank_run(tmp_path_factory):
    """Run dir of an uninterrupted 2-rank torchrun-style run (tests/launch.py) of
    configs/tiny.yaml on this machine: what every 2-rank resume of that config must reproduce
    bitwise. Shared by several modules: read it, never write into it."""
    import launch

    d = str(tmp_path_factory.mktemp("tiny-two-rank") / "run")
    assert launch.run(2, "configs/tiny.yaml", [f"run.dir={d}"], d) == [0, 0]
    return d


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    """A checkpoint store keeping two steps, on a local folder and on fsspec's memory://."""
    from clusterflow.storage.store import CheckpointStore
    from clusterflow.storage.tensors import TORCH

    if request.param == "local":
        return CheckpointStore(str(tmp_path / "ck"), keep_last=2, codec=TORCH)
    import uuid

    return CheckpointStore(f"memory://ck-{uuid.uuid4().hex}", keep_last=2, codec=TORCH)


@pytest.fixture(scope="session")
def cluster():
    """The local Slurm cluster (partitions low and high: node1-2; wide: node1-3), booted
    (idempotently) by tests/slurm/cluster.sh."""
    if os.geteuid() != 0 or shutil.which("sinfo") is None and shutil.which("apt-get") is None:
        pytest.skip("the local Slurm cluster needs root and Debian's slurm-wlm")
    out = subprocess.run(
        ["bash", os.path.join(REPO, "tests", "slurm", "cluster.sh"), "up"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="session")
def reference_run(cluster, tmp_path_factory):
    """An uninterrupted run of configs/tiny.yaml on two nodes: what every resume must reproduce
    bitwise."""
    from slurmjobs import submit

    d = str(tmp_path_factory.mktemp("reference") / "run")
    _, out = submit(d, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return d, out
