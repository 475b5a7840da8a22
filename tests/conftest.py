import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite runs in parallel (pytest-xdist, `--dist loadgroup`: tests/run.sh), in groups that one
# worker runs in order: every test of the one local Slurm cluster is in SLURM_GROUP (its jobs
# would otherwise queue behind or preempt each other); tests that share a module- or
# session-scoped fixture (a run they only read) are grouped by it, so it is built once; every
# other test is a group of its own. Groups are handed out longest first: the Slurm group, then
# those with a slow test, then the rest in file order. In the Slurm group, whose chain ends the
# suite, a test marked `cpu_bound` (its time follows the machine's load more than Slurm's waits)
# runs last: by then the other workers are done and its jobs have the CPUs to themselves.
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
        if group == SLURM_GROUP:
            return 0, item.get_closest_marker("cpu_bound") is not None
        return 1 if group in slow else 2, False

    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    items.sort(key=rank)  # stable: file order within each rank


# CLUSTERFLOW_TEST_TIMELINE=FILE: each test's worker, start and end (wall clock) appended to FILE as
# a JSON line, setup and teardown included; tests/timeline.py reads it back as each worker's chain,
# which shows the group that ends the suite. Where the cgroup v1 CPU accounting is writable (root),
# each worker runs in a cgroup of its own and the line also holds the CPU seconds the test's
# processes spent: the worker's and every process it started, whatever their session (ranks, rank
# servers, commands), but not a Slurm job's (slurmd starts those), the suite's CPU budget by test.
TIMELINE = "CLUSTERFLOW_TEST_TIMELINE"
CPUACCT = "/sys/fs/cgroup/cpuacct"


class _WorkerCPU:
    """This worker's own accounting cgroup, opened at its first test (None where there is none)."""

    usage = None

    @classmethod
    def seconds(cls):
        if cls.usage is None:
            cls.usage = cls._open() or ""
        if not cls.usage:
            return None
        with open(cls.usage) as f:
            return int(f.read()) / 1e9

    @staticmethod
    def _open():
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        parent = os.path.join(CPUACCT, "clusterflow-tests")
        group = os.path.join(parent, f"{worker}-{os.getpid()}")
        try:
            for old in os.listdir(parent) if os.path.isdir(parent) else ():
                with contextlib.suppress(OSError):  # an earlier suite's: gone once it is empty
                    os.rmdir(os.path.join(parent, old))
            os.makedirs(group, exist_ok=True)
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            return None
        return os.path.join(group, "cpuacct.usage")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TIMELINE)
    start, cpu = time.time(), _WorkerCPU.seconds() if path else None
    try:
        return (yield)
    finally:
        if path:
            line = {
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                "test": item.nodeid,
                "group": _group(item),
                "start": start,
                "end": time.time(),
            }
            if cpu is not None:
                line["cpu"] = round(_WorkerCPU.seconds() - cpu, 2)
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")


# The Slurm group is the suite's longest chain, and its jobs' speed is the CPU the other workers
# leave them: the scheduler shares the two cores between sessions (autogroup), and every run a test
# starts is a session of its own, so a Slurm job's ranks got one share among many and its tests ran
# 40-60 % longer beside the other workers than alone. Where the cgroup v1 cpu controller is
# writable (root), a worker runs each test outside the Slurm group in one cgroup, which every
# process the test starts inherits whatever its session: all of them together weigh as one
# session, as much as a Slurm job, and the Slurm group's tests run in the root group as before.
CPU = "/sys/fs/cgroup/cpu"


class _CPUShare:
    """Moves this worker between the shared cgroup of the tests outside the Slurm group and the
    root group (a no-op where the cgroup cannot be written)."""

    shared = None  # the shared group's cgroup.procs, "" where there is none

    @classmethod
    def enter(cls, slurm):
        if cls.shared is None:
            cls.shared = cls._open() or ""
        if cls.shared:
            target = os.path.join(CPU, "cgroup.procs") if slurm else cls.shared
            with contextlib.suppress(OSError), open(target, "w") as f:
                f.write(str(os.getpid()))

    @staticmethod
    def _open():
        group = os.path.join(CPU, "clusterflow-tests")
        try:
            os.makedirs(group, exist_ok=True)
            with open(os.path.join(group, "cpu.shares"), "w") as f:
                f.write("1024")  # the weight of one session
        except OSError:
            return None
        return os.path.join(group, "cgroup.procs")


# Outside the Slurm group no test may reach the live cluster: its queue holds the Slurm tests' real
# jobs, whose ids meet any id a test makes up ("79" read `running` because a real job 79 was).
# Before each such test, Slurm's client commands on PATH are replaced by a guard that records the
# call and answers as a controller that cannot be reached (subprocesses inherit PATH, so a run a
# test starts is held too); a test that called one fails naming the call. A test that needs an
# answer passes its own (a `queue_state` argument, or a fake command of its own first on PATH).
SLURM_COMMANDS = (
    "sacct",
    "salloc",
    "sattach",
    "sbatch",
    "scancel",
    "scontrol",
    "sinfo",
    "sprio",
    "squeue",
    "srun",
    "sshare",
    "sstat",
    "strigger",
)
GUARD_LOG = "CLUSTERFLOW_TEST_SLURM_GUARD_LOG"
_GUARD = rf"""#!/bin/sh
[ -n "${GUARD_LOG}" ] && printf '%s\n' "$(basename "$0") $*" >> "${GUARD_LOG}"
echo "$(basename "$0"): Unable to contact slurm controller (a test outside the Slurm group may not \
reach the live cluster: tests/conftest.py)" >&2
exit 1
"""


def _guarded(item):
    return item.get_closest_marker("slurm") is None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _CPUShare.enter(slurm=not _guarded(item))
    if _guarded(item):
        guard_dir = _guard_dir(item.session)
        fd, log = tempfile.mkstemp(prefix="slurm-guard-", suffix=".log")
        os.close(fd)
        item._slurm_guard = (os.environ.get("PATH"), os.environ.get(GUARD_LOG), log)
        os.environ["PATH"] = guard_dir + os.pathsep + os.environ.get("PATH", "")
        os.environ[GUARD_LOG] = log
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    _fail_on_slurm_calls(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        result = yield
    finally:
        saved = getattr(item, "_slurm_guard", None)
        if saved is not None:
            _restore_env("PATH", saved[0])
            _restore_env(GUARD_LOG, saved[1])
    _fail_on_slurm_calls(item)
    if saved is not None:
        os.unlink(saved[2])
    return result


def _guard_dir(session):
    """The folder of guard commands, made once per pytest process."""
    existing = getattr(session, "_slurm_guard_dir", None)
    if existing and os.path.isdir(existing):
        return existing
    d = session._slurm_guard_dir = tempfile.mkdtemp(prefix="slurm-guard-bin-")
    script = os.path.join(d, "guard.sh")
    with open(script, "w") as f:
        f.write(_GUARD)
    os.chmod(script, 0o755)
    for name in SLURM_COMMANDS:
        os.symlink(script, os.path.join(d, name))
    return d


def _restore_env(key, value):
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _fail_on_slurm_calls(item):
    """Fail the test when it called a guarded command since the last look (the log is emptied,
    so a call is reported once: in the phase that made it)."""
    saved = getattr(item, "_slurm_guard", None)
    if saved is None:
        return
    with open(saved[2], "r+") as f:
        calls = [line.strip() for line in f if line.strip()]
        f.truncate(0)
    if calls:
        more = f" (and {len(calls) - 5} more)" if len(calls) > 5 else ""
        test = item.nodeid.partition("@")[0]  # pytest-xdist adds "@<group>"
        pytest.fail(
            f"{test} is outside the Slurm group but called Slurm's commands: "
            f"{'; '.join(calls[:5])}{more}. Give the test its own answers (the `fake_slurm` "
            "fixture, or a queue_state argument), or take the `cluster` fixture",
            pytrace=False,
        )


class FakeSlurm:
    """Slurm's client commands as a test defines them, first on PATH (for this process and every
    process it starts): each answers what :meth:`answer` set and records its arguments. The
    test's own queue, never the live cluster's."""

    def __init__(self, folder):
        self.folder = folder
        self.log = os.path.join(folder, "calls.log")
        os.makedirs(folder, exist_ok=True)

    def answer(self, name, stdout="", stderr="", code=0):
        """``name`` (``squeue``, ``sacct``, ``scontrol``...) prints ``stdout`` and ``stderr`` and
        exits with ``code``, whatever it is asked."""
        path = os.path.join(self.folder, name)
        with open(path, "w") as f:
            f.write(
                "#!/bin/sh\n"
                f'echo "$(basename "$0") $*" >> {shlex.quote(self.log)}\n'
                f"printf %s {shlex.quote(stdout)}\n"
                f"printf %s {shlex.quote(stderr)} >&2\n"
                f"exit {int(code)}\n"
            )
        os.chmod(path, 0o755)
        return self

    def forgot_every_job(self):
        """A Slurm that no longer knows any of the test's made-up job ids (MinJobAge passed)."""
        invalid = "slurm_load_jobs error: Invalid job id specified\n"
        self.answer("squeue", stderr=invalid, code=1)
        self.answer("sacct")  # no record: no accounting kept for the job
        self.answer("scontrol", stderr=invalid, code=1)
        return self

    def calls(self):
        """Each call made so far: the command and its arguments, one string each."""
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [line.strip() for line in f if line.strip()]


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """A :class:`FakeSlurm` first on PATH; a command the test does not answer fails as one that is
    not installed (exit 127)."""
    fake = FakeSlurm(str(tmp_path / "fake-slurm"))
    for name in SLURM_COMMANDS:
        fake.answer(name, stderr=f"{name} is not installed in this test\n", code=127)
    monkeypatch.setenv("PATH", fake.folder + os.pathsep + os.environ["PATH"])
    return fake


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


def billion_laughs():
    """A config.yaml of under 1 KB whose aliases expand to a billion strings ("billion laughs"),
    a mapping of sections as clusterflow's own."""
    lines = ["lol0: &lol0 [" + ", ".join(["lol"] * 10) + "]"]
    for i in range(1, 9):
        lines.append(f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 10) + "]")
    lines += ["run: {dir: .}", "train: {epochs: 3}", "task: {params: {lol: *lol8}}"]
    return "\n".join(lines) + "\n"


# A config.yaml of 30,000 lists nested in each other (a reader that recurses runs out of stack).
DEEP_LISTS = "run: {dir: .}\ntrain: " + "[" * 30_000 + "]" * 30_000 + "\n"


def write_status_record(run_dir, **fields):
    """A status.json as a job left it (a fixture record: any state, any fields, as another
    version or a hand could have written it); the package itself writes it only through
    clusterflow/rundir/transitions.py."""

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
    if os.environ.get("CLUSTERFLOW_NO_SLURM") == "1":
        pytest.skip("CLUSTERFLOW_NO_SLURM=1: the local Slurm cluster is left down")
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


# One node, all of it, two ranks, no restart inside the job: the shape of the runs that leave a
# bad node out on requeue (tests/test_slurm_node_exclusion.py).
ONE_NODE = (
    "cluster.nodes=1",
    "cluster.tasks_per_node=2",
    "cluster.exclusive=true",
    "cluster.restarts_in_job=0",
)


@pytest.fixture(scope="session")
def one_node_reference(cluster, tmp_path_factory):
    """An uninterrupted run of configs/tiny.yaml on one node with two ranks (``ONE_NODE``):
    submit's route on one node, and what a run moved from node to node must reproduce."""
    from slurmjobs import submit

    d = str(tmp_path_factory.mktemp("one_node_reference") / "run")
    _, out = submit(d, *ONE_NODE, wait=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return d, out
