"""tests/launch.py forks its ranks from a server that has imported torch (tests/rankserver.py):
each forked rank must be what a fresh interpreter started with the same command would be, to the
rank and to the test that signals it and reads its exit status and log."""

import json
import os
import signal
import subprocess
import sys
import time

import launch
import pytest

# What a rank sees of its process, and the ways a Python program can end.
PROBE = r"""
import atexit, json, os, signal, sys, threading, time
mode = sys.argv[1]
view = {
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path": sys.path, "cwd": os.getcwd(),
    "env": dict(os.environ), "main": __name__, "file": __file__,
    "session": os.getsid(0) == os.getpid(), "group": os.getpgid(0) == os.getpid(),
    "threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
    "signals": {int(s): str(signal.getsignal(s)) for s in (2, 13, 15, 25)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "torch": "torch" in sys.modules, "clusterflow": "clusterflow" in sys.modules,
}
print(json.dumps(view), flush=True)
atexit.register(print, "atexit ran")
if mode == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread joined"))).start()
elif mode == "exit":
    sys.exit(3)
elif mode == "raise":
    raise RuntimeError("raised by the probe")
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "wait":
    open(sys.argv[2], "w").close()
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    path = d / "probe.py"
    path.write_text(PROBE)
    return str(path)


def _start(argv, tmp_path, name, probe, fresh=False):
    """``argv`` as launch.py starts a rank (forked), or as a fresh interpreter when ``fresh``;
    the probe's folder on PYTHONPATH (for ``-m probe``)."""
    out = tmp_path / f"{name}.log"
    env = dict(os.environ, PROBE_MARK="1", PYTHONPATH=os.path.dirname(probe))
    with open(out, "a") as f:
        if fresh:
            p = subprocess.Popen(
                argv,
                cwd=tmp_path,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        else:
            p = launch.popen(argv, env, str(tmp_path), f)
    return p, out


def _view(out):
    return json.loads(out.read_text().splitlines()[0])


def test_a_forked_rank_sees_what_a_fresh_interpreter_sees(tmp_path, probe):
    for argv in ([sys.executable, probe, "plain"], [sys.executable, "-m", "probe", "plain"]):
        forked, out = _start(argv, tmp_path, "forked", probe)
        fresh, fresh_out = _start(argv, tmp_path, "fresh", probe, fresh=True)
        assert isinstance(forked, launch.Forked), "the rank was not forked by the rank server"
        assert forked.wait(120) == fresh.wait(120) == 0, out.read_text() + fresh_out.read_text()
        mine, theirs = _view(out), _view(fresh_out)
        assert mine["torch"] and not theirs["torch"]  # the one difference: torch is imported
        assert not mine["clusterflow"]  # the project is imported by the rank itself
        mine.pop("torch"), theirs.pop("torch")
        mine["env"].pop("_", None), theirs["env"].pop("_", None)
        assert mine == theirs
        assert mine["session"] and mine["group"] and mine["tasks"] == 1
        assert out.read_text().endswith("atexit ran\n")
        out.unlink(), fresh_out.unlink()


@pytest.mark.parametrize(
    ("mode", "code", "says"),
    [
        ("exit", 3, "atexit ran"),
        ("raise", 1, "RuntimeError: raised by the probe"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
        ("thread", 0, "thread joined\natexit ran"),
    ],
)
def test_a_forked_rank_ends_as_a_python_process_ends(tmp_path, probe, mode, code, says):
    p, out = _start([sys.executable, probe, mode], tmp_path, mode, probe)
    assert p.wait(120) == code, out.read_text()
    assert says in out.read_text()


# (SIGINT: what it does depends on the test process's own disposition, which a rank inherits
# forked or not, as test_a_forked_rank_sees_what_a_fresh_interpreter_sees compares.)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_forked_rank_is_signalled_by_its_pid_and_group(tmp_path, probe, sig):
    ready = tmp_path / "ready"
    p, out = _start([sys.executable, probe, "wait", str(ready)], tmp_path, "wait", probe)
    t0 = time.time()
    while not ready.exists():
        assert p.poll() is None, out.read_text()
        assert time.time() - t0 < 120
        time.sleep(0.05)
    assert p.poll() is None and p.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.1)
    launch.kill([p], sig)
    assert p.wait(60) == -sig, out.read_text()
    p.kill()  # a rank that has ended is not signalled again (its pid may be another's)


def test_neighbouring_forked_ranks_hash_strings_apart(tmp_path):
    """Started ranks each draw a hash seed: a set of strings iterates in another order on each,
    which code that ranks must agree on has to survive. Forked ranks of neighbouring RANKs come
    from two servers, so they differ as started ranks do."""
    script = tmp_path / "hash.py"
    script.write_text('import os\nprint(os.environ["RANK"], hash("clusterflow"))\n')
    procs = launch.start(2, None, [], str(tmp_path / "logs"), command=[sys.executable, str(script)])
    assert launch.wait(procs, timeout=120) == [0, 0]
    assert all(isinstance(p, launch.Forked) for p in procs)
    logs = sorted((tmp_path / "logs").iterdir())
    hashes = dict(line.split() for log in logs for line in log.read_text().splitlines())
    assert set(hashes) == {"0", "1"} and hashes["0"] != hashes["1"], hashes
