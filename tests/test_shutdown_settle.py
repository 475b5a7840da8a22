"""The pause before a process group goes (distributed/comm.py's shutdown): as long as another
thread of the process is runnable (a gloo worker that waits for the GIL to free a finished
collective's tensors), at most SETTLE_S; a few polls when every other thread sleeps."""

import threading
import time

from clusterflow.distributed import comm


def _settle_s():
    t0 = time.monotonic()
    comm._settle()
    return time.monotonic() - t0


def test_other_threads_asleep_end_the_settle_before_its_limit(monkeypatch):
    monkeypatch.setattr(comm, "SETTLE_S", 10.0)
    sleeper = threading.Event()
    t = threading.Thread(target=sleeper.wait)
    t.start()
    try:
        assert comm._others_runnable() is False
        assert _settle_s() < 10.0
    finally:
        sleeper.set()
        t.join()


def test_a_runnable_thread_holds_the_settle_until_it_sleeps(monkeypatch):
    monkeypatch.setattr(comm, "SETTLE_S", 10.0)
    started = threading.Event()
    busy_until = time.monotonic() + 0.5

    def work():  # wants the GIL the whole time, as a thread freeing tensors does
        started.set()
        while time.monotonic() < busy_until:
            pass

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    took = _settle_s()
    ended = time.monotonic()
    t.join()
    assert ended >= busy_until and took < 10.0


def test_a_thread_that_never_sleeps_is_waited_for_settle_s(monkeypatch):
    monkeypatch.setattr(comm, "SETTLE_S", 0.3)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        took = _settle_s()
    finally:
        stop.set()
        t.join()
    assert took >= 0.3
