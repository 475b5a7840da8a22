"""Code frozen at submission: a task package in a git repo is snapshotted into the run dir, the
original is edited, and a fresh interpreter imports the submitted version from the snapshot."""

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from clusterflow.errors import UserError
from clusterflow.rundir import frozen_code as snapshot
from clusterflow.rundir.paths import RunPaths

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repo holding package ``mytasks`` (committed), with an uncommitted edit and an untracked
    file."""
    r = tmp_path / "repo"
    write(str(r / "mytasks" / "__init__.py"), "")
    write(str(r / "mytasks" / "task.py"), 'VALUE = "committed"\n')
    write(str(r / "mytasks" / "data" / "vocab.txt"), "a b c\n")
    write(str(r / "mytasks" / "__pycache__" / "task.cpython-311.pyc"), "junk")
    write(str(r / "README"), "repo\n")
    git(r, "init", "-q")
    git(r, "add", "mytasks/__init__.py", "mytasks/task.py", "mytasks/data/vocab.txt", "README")
    git(r, "commit", "-q", "-m", "first")
    write(str(r / "mytasks" / "task.py"), 'VALUE = "submitted"\n')
    write(str(r / "mytasks" / "helper.py"), 'HELP = "untracked"\n')
    monkeypatch.syspath_prepend(str(r))
    return str(r)


def run_python(code, cwd, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_job_imports_the_submitted_version_after_the_original_is_edited(repo, tmp_path):
    run_dir = str(tmp_path / "run")
    manifest = snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=False, cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    assert (
        manifest["module"] == "mytasks"
        and manifest["git"]["commit"] == head
        and manifest["git"]["dirty"]
    )
    assert manifest["git"]["untracked"] == ["mytasks/helper.py"]
    version_dir = os.path.join(run_dir, "code", manifest["version"])
    assert 'VALUE = "submitted"' in open(os.path.join(version_dir, "git.diff")).read()
    copied = sorted(
        os.path.relpath(os.path.join(d, f), version_dir)
        for d, _, fs in os.walk(version_dir)
        for f in fs
    )
    assert copied == [
        "git.diff",
        "mytasks/__init__.py",
        "mytasks/data/vocab.txt",
        "mytasks/helper.py",
        "mytasks/task.py",
        "snapshot.json",
    ]
    # the user edits the code while the job waits in the queue
    write(os.path.join(repo, "mytasks", "task.py"), 'VALUE = "edited while pending"\n')
    env = {
        "PYTHONPATH": repo
    }  # the original is importable, and first, unless the snapshot is activated
    probe = (
        "import multiprocessing, os, subprocess, sys\n"
        "from clusterflow.rundir import frozen_code as snapshot\n"
        "from clusterflow.rundir.paths import RunPaths\n"
        "{activate}"
        "import mytasks.task, mytasks.helper\n"
        "print(mytasks.task.VALUE, mytasks.helper.HELP, mytasks.task.__file__)\n"
        # a spawned DataLoader worker gets the parent's sys.path
        "with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "    print(pool.apply(eval, ('__import__(\"mytasks.task\").task.VALUE',)))\n"
        # any other child process gets PYTHONPATH (run elsewhere: Python puts the cwd first)
        "print(subprocess.run([sys.executable, '-c',"
        " 'import mytasks.task; print(mytasks.task.VALUE)'],"
        " cwd='/', capture_output=True, text=True).stdout.strip())\n"
    )
    plain = run_python(probe.format(activate=""), cwd=repo, env_extra=env).splitlines()
    assert plain[0].startswith(
        "edited while pending"
    )  # the control: without the snapshot the edit is seen
    frozen = run_python(
        probe.format(activate=f"snapshot.activate(RunPaths({run_dir!r}))\n"),
        cwd=repo,
        env_extra=env,
    ).splitlines()
    value, helper, path = frozen[0].split(" ", 2)
    assert (value, helper) == ("submitted", "untracked") and path.startswith(version_dir)
    assert frozen[1:] == ["submitted", "submitted"]


def test_a_module_imported_before_activation_is_replaced(repo, tmp_path):
    run_dir = str(tmp_path / "run")
    snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    write(os.path.join(repo, "mytasks", "task.py"), 'VALUE = "edited"\n')
    out = run_python(
        "import mytasks.task\n"
        "from clusterflow.rundir import frozen_code as snapshot\n"
        "from clusterflow.rundir.paths import RunPaths\n"
        f"snapshot.activate(RunPaths({run_dir!r}))\n"
        "import importlib, mytasks.task as t\nprint(t.VALUE)",
        cwd=repo,
        env_extra={"PYTHONPATH": repo},
    )
    assert out == "submitted"


def test_finding_the_package_imports_nothing(repo, tmp_path):
    write(
        os.path.join(repo, "mytasks", "__init__.py"),
        "raise RuntimeError('imported at submission')\nimport torch\n",
    )
    code = (
        f"import sys; sys.path.insert(0, {repo!r})\n"
        "from clusterflow.rundir import frozen_code as snapshot\n"
        "from clusterflow.rundir.paths import RunPaths\n"
        f"m = snapshot.take(RunPaths({str(tmp_path / 'run')!r}), 'mytasks.task:Task')\n"
        "print(m['files'], 'torch' in sys.modules, 'mytasks' in sys.modules)"
    )
    assert run_python(code, cwd=str(tmp_path)) == "4 False False"


def test_same_code_reuses_the_version_and_changed_code_adds_one(repo, tmp_path):
    run_dir = str(tmp_path / "run")
    first = snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    assert snapshot.take(RunPaths(run_dir), "mytasks.task:Task")["version"] == first["version"]
    write(os.path.join(repo, "mytasks", "task.py"), 'VALUE = "second"\n')
    second = snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    assert second["version"] != first["version"]
    assert sorted(
        n for n in os.listdir(os.path.join(run_dir, "code")) if not n.endswith(".json")
    ) == sorted([first["version"], second["version"]])
    assert snapshot.describe(RunPaths(run_dir))["version"] == second["version"]
    # opting out removes the pointer: no stale snapshot is imported
    assert snapshot.take(RunPaths(run_dir), "mytasks.task:Task", enabled=False) is None
    assert (
        snapshot.describe(RunPaths(run_dir)) is None
        and snapshot.activate(RunPaths(run_dir)) is None
    )


def test_a_moved_run_dir_still_activates(repo, tmp_path):
    run_dir = str(tmp_path / "run")
    snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    moved = str(tmp_path / "moved")
    shutil.move(run_dir, moved)
    out = run_python(
        "from clusterflow.rundir import frozen_code as snapshot\n"
        "from clusterflow.rundir.paths import RunPaths\n"
        f"snapshot.activate(RunPaths({moved!r}))\n"
        "import mytasks.task\nprint(mytasks.task.__file__)",
        cwd=str(tmp_path),
    )
    assert out.startswith(moved)


def test_describe_gives_status_the_commit(repo, tmp_path):
    run_dir = str(tmp_path / "run")
    m = snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    d = snapshot.describe(RunPaths(run_dir))
    assert d == {
        "module": "mytasks",
        "version": m["version"],
        "commit": m["git"]["commit"],
        "dirty": True,
        "path": os.path.join(run_dir, "code", m["version"]),
    }
    assert json.load(open(os.path.join(d["path"], "snapshot.json")))["source"] == os.path.realpath(
        os.path.join(repo, "mytasks")
    )


def test_too_much_code_is_refused_naming_the_largest_files(repo, tmp_path):
    with open(os.path.join(repo, "mytasks", "data", "weights.bin"), "wb") as f:
        f.write(b"\0" * 3 * 2**20)
    with pytest.raises(UserError) as e:
        snapshot.take(RunPaths(str(tmp_path / "run")), "mytasks.task:Task", max_bytes=2**20)
    msg = str(e.value)
    assert (
        "over the snapshot limit of 1 MiB" in msg
        and "mytasks/data/weights.bin (3.0 MiB)" in msg
        and "run.snapshot_code=false" in msg
    )
    assert not os.path.exists(os.path.join(tmp_path, "run", "code", "current.json"))


def test_a_single_module_outside_git(tmp_path, monkeypatch):
    d = tmp_path / "plain"
    write(str(d / "onefile.py"), "X = 1\n")
    monkeypatch.syspath_prepend(str(d))
    m = snapshot.take(RunPaths(str(tmp_path / "run")), "onefile:Task")
    assert m["git"] is None and m["files"] == 1
    assert os.path.exists(os.path.join(tmp_path, "run", "code", m["version"], "onefile.py"))


def test_installed_and_builtin_code_is_not_copied(tmp_path):
    assert (
        snapshot.locate("clusterflow.tasks.pseudo_id:PseudoIDTask") is None
    )  # runs from where clusterflow is installed
    assert snapshot.locate("yaml:Loader") is None  # site-packages
    assert snapshot.locate("json:JSONDecoder") is None  # standard library
    assert snapshot.locate("sys:x") is None  # built in
    assert snapshot.take(RunPaths(str(tmp_path / "run")), "yaml:Loader") is None
    with pytest.raises(UserError, match="no module named 'no_such_pkg_xyz' on the Python path"):
        snapshot.locate("no_such_pkg_xyz.mod:Task")


def test_a_missing_snapshot_is_a_clear_error(repo, tmp_path):
    run_dir = str(tmp_path / "run")
    m = snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    shutil.rmtree(os.path.join(run_dir, "code", m["version"]))
    with pytest.raises(UserError, match="is missing or incomplete; submit the run again"):
        snapshot.activate(RunPaths(run_dir), environ={})


def test_activating_while_another_thread_imports(repo, tmp_path):
    """A rank activates the snapshot while a thread of its process still adds to sys.modules
    (as a warm standby's preloaded modules do): the snapshot's modules are forgotten all the
    same, and nothing fails."""
    run_dir = str(tmp_path / "run")
    snapshot.take(RunPaths(run_dir), "mytasks.task:Task")
    stop = threading.Event()

    def imports():
        n = 0
        while not stop.is_set():
            sys.modules[f"_clusterflow_test_racer_{n % 64}"] = sys
            sys.modules.pop(f"_clusterflow_test_racer_{(n + 32) % 64}", None)
            n += 1

    racer = threading.Thread(target=imports, daemon=True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as CPython allows
    racer.start()
    try:
        for _ in range(100):
            sys.modules["mytasks.stale"] = sys
            snapshot.activate(RunPaths(run_dir), environ={})
            assert "mytasks.stale" not in sys.modules
    finally:
        stop.set()
        racer.join()
        sys.setswitchinterval(old)
        for n in range(64):
            sys.modules.pop(f"_clusterflow_test_racer_{n}", None)
