"""The pause before a process group goes (distributed/comm.py's shutdown): as long as another
thread of the process is runnable (a gloo worker that waits for the GIL to free a finished
collective's tensors), at most SETTLE_S; a few polls when every other thread sleeps. Each case
runs in a fresh interpreter: a pytest worker holds threads of its own and of earlier tests. The
cases' threads are daemons, so a failed assertion fails the case instead of leaving the
interpreter waiting for them at its exit."""

import subprocess
import sys

import pytest
from conftest import REPO

PRELUDE = """
import threading, time
from clusterflow.distributed import comm
def settle_s():
    t0 = time.monotonic()
    comm._settle()
    return time.monotonic() - t0
"""

CASES = {
    # Every other thread asleep: the settle ends before its limit.
    "asleep": """
comm.SETTLE_S = 10.0
sleeper = threading.Event()
t = threading.Thread(target=sleeper.wait, daemon=True)
t.start()
# A thread the kernel has not run yet is runnable: wait until the sleeper sleeps.
deadline = time.monotonic() + 60
while comm._others_runnable() and time.monotonic() < deadline:
    time.sleep(0.01)
assert comm._others_runnable() is False
took = settle_s()
sleeper.set()
t.join()
assert took < 10.0, took
""",
    # A thread that wants the GIL for half a second (as a thread freeing tensors does) holds the
    # settle until it sleeps.
    "busy": """
comm.SETTLE_S = 10.0
started = threading.Event()
busy_until = time.monotonic() + 0.5
def work():
    started.set()
    while time.monotonic() < busy_until:
        pass
t = threading.Thread(target=work, daemon=True)
t.start()
started.wait()
took = settle_s()
ended = time.monotonic()
t.join()
assert ended >= busy_until and took < 10.0, (ended, busy_until, took)
""",
    # A thread that never sleeps: the settle waits SETTLE_S, no longer.
    "never sleeps": """
comm.SETTLE_S = 0.3
stop = threading.Event()
def spin():
    while not stop.is_set():
        pass
t = threading.Thread(target=spin, daemon=True)
t.start()
took = settle_s()
stop.set()
t.join()
assert took >= 0.3, took
""",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_settle_waits_for_runnable_threads_only(case):
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + CASES[case]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # the child imports torch: a minute or more under the suite's load
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
